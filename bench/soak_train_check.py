"""The training lane's records in a soak's history and the invariants ``check`` reads off them
(pure: no bus, no processes; ``bench/soak_check.py`` holds the rest and reports these with
them).

With ``belayer soak --train`` the history holds ``TrainLane`` (the lane started),
``Trained`` (each step the lane saw finished: its trainer step, the trajectories trained, the
weights' version and sha256 where the trainer said them), ``TrainerResumedSeen`` (every
``trainer_resumed`` event: a restarted trainer continued from its checkpoint), ``TrainError``
(a lane step that failed) and ``TrainLaneEnded``. The invariants:

- ``trained_once``: no trajectory was trained twice (in two steps, or twice in one);
- ``trained_published``: every trajectory trained was published by a rollout the soak
  followed (a ``TrajectorySeen`` of ``bench/soak_check.py``);
- ``train_steps``: the steps finished strictly increase, none finished twice;
- ``train_lane``: the lane trained at least one step, again after every ``trainer-kill``,
  never failed a step, and ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

TRAIN_INVARIANTS = ("trained_once", "trained_published", "train_steps", "train_lane")


class TrainLane(msgspec.Struct, tag="train_lane", kw_only=True):
    """The training lane started: ``tasks`` × ``n`` trajectories a step, the trainer at
    ``base_step``."""

    t: float
    workload: str
    tasks: int
    n: int
    base_step: int


class Trained(msgspec.Struct, tag="trained", kw_only=True):
    """A training step the lane saw finished. ``via``: ``event`` (its ``train_step``),
    ``republished`` (its ``train_step`` published again by a trainer resumed from the step's
    checkpoint: killed after that checkpoint, the first publication may have been lost) or
    ``resume`` (such a trainer's ``trainer_resumed`` came first: the ids are the step's durable
    plan, empty when it could not be read)."""

    step: int
    rollout: str
    trajectory_ids: list[str]
    version: int
    t: float
    weights_sha256: str = ""
    via: str = "event"


class TrainerResumedSeen(msgspec.Struct, tag="trainer_resumed", kw_only=True):
    """A ``trainer_resumed`` event: a (re)started trainer continued from its checkpoint."""

    step: int
    version: int
    trained: int
    replay_steps: int
    t: float


class TrainError(msgspec.Struct, tag="train_error", kw_only=True):
    """A lane step that failed (``step``: the lane's; the rollout, when it had one)."""

    step: int
    t: float
    error: str
    rollout: str = ""


class TrainLaneEnded(msgspec.Struct, tag="train_lane_end", kw_only=True):
    """The lane stopped: ``steps`` trained."""

    t: float
    steps: int


TrainRecord = Trained | TrainerResumedSeen | TrainError | TrainLane | TrainLaneEnded


def check_training(
    records: list[Any], published: set[str], kills: list[float]
) -> Iterator[tuple[str, str, str]]:
    """``(invariant, subject, detail)`` for every broken training invariant: ``published`` are
    the trajectory ids rollouts published, ``kills`` the times of the ``trainer-kill`` faults
    injected. Nothing when the history has no record of a training lane."""
    if not any(isinstance(r, TrainLane | Trained | TrainError | TrainLaneEnded) for r in records):
        return  # (a trainer_resumed alone: the node's trainer, no lane of this soak)
    steps = [r for r in records if isinstance(r, Trained)]
    yield from _trained_once(steps)
    for s in steps:
        if missing := [t for t in s.trajectory_ids if t not in published]:
            yield (
                "trained_published", f"step {s.step}",
                f"{len(missing)} trained, never published: {missing[:4]}",
            )  # fmt: skip
    yield from _train_steps(steps)
    yield from _train_lane(records, steps, kills)


def _trained_once(steps: Iterable[Trained]) -> Iterator[tuple[str, str, str]]:
    first: dict[str, int] = {}
    for s in steps:
        for tid in s.trajectory_ids:
            if tid in first:
                yield ("trained_once", tid, f"trained in step {first[tid]} and step {s.step}")
            else:
                first[tid] = s.step


def _train_steps(steps: list[Trained]) -> Iterator[tuple[str, str, str]]:
    last = None
    for s in steps:
        if last is not None and s.step <= last:
            what = "finished twice" if s.step == last else f"after step {last}"
            yield ("train_steps", f"step {s.step}", what)
        last = s.step if last is None else max(last, s.step)


def _train_lane(
    records: list[Any], steps: list[Trained], kills: list[float]
) -> Iterator[tuple[str, str, str]]:
    for e in records:
        if isinstance(e, TrainError):
            yield ("train_lane", f"lane step {e.step}", e.error)
    if not steps:
        yield ("train_lane", "lane", "no step trained")
    elif kills and max(s.t for s in steps) < max(kills):
        yield ("train_lane", "lane", "no step trained after the last trainer-kill")
    if not any(isinstance(r, TrainLaneEnded) for r in records):
        yield ("train_lane", "lane", "the lane did not end")


def trained_counts(records: list[Any]) -> tuple[int, int]:
    """(steps trained, distinct trajectories trained) of the lane."""
    steps = [r for r in records if isinstance(r, Trained)]
    return len(steps), len({t for s in steps for t in s.trajectory_ids})
