"""The run's counters, each computed from what it counts (ids, texts), never derived from
another counter: the slots lost (submitted slots with no trajectory the trainer trained), the
exact-match accuracy of the step's answers, and whether a step's log-probability check
compared anything at all."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from model.tokenizer import Tokenizer
from schemas.rollout import Trajectory
from workloads import Workload, exact_match


def lost_slots(
    slots: int, trajectories: Sequence[Trajectory], trained_ids: Collection[str]
) -> list[int]:
    """The slots ``0..slots-1`` of a rollout for which the trainer trained no trajectory:
    a slot counts as trained only when one of its published trajectories' ids is among
    ``trained_ids`` (the ids the trainer's ``train_step`` names)."""
    trained = {t.slot for t in trajectories if t.trajectory_id in trained_ids}
    return [slot for slot in range(slots) if slot not in trained]


def exact_share(
    workload: Workload, trajectories: Sequence[Trajectory], tokenizer: Tokenizer
) -> float | None:
    """Exact-match accuracy of the trajectories' final answers (each response decoded as the
    controller scored it: special tokens dropped); ``None`` when the workload's tasks are not
    answer tasks, or there is no trajectory."""
    found: list[bool] = []
    for t in trajectories:
        exact = exact_match(workload.task(t.task_id), tokenizer.text(list(t.response_ids)))
        if exact is None:
            return None
        found.append(exact)
    return sum(found) / len(found) if found else None


def compared_nothing(step: int, compared: int) -> str | None:
    """The error of a step whose training–inference log-probability check compared no token
    (its difference would read 0 while nothing was compared); ``None`` when it compared."""
    if compared > 0:
        return None
    return (
        f"step {step}: the trainer compared no log-probability with the engine's "
        "(logprob_tokens_compared 0); logprob_diff means nothing for this step"
    )
