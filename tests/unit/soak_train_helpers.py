"""Helpers of the soak training lane's unit tests (``test_soak_train.py``,
``test_train_step_republished.py``): a run context, a lane over a hand-fed ``EventTail`` (no
bus), and a ``train_step`` event."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from bench.soak_train import TrainLane
from common.events import EventTail
from schemas.events import EventBase, TrainStep
from services.rl.loop import RunContext
from services.rl.options import RunOptions, RunState

NOTHING = cast(Any, None)


def context(tmp_path: Path) -> RunContext:
    state = RunState(
        run_id="soakrun", workload="math", dataset="", model_dir="", model_fingerprint="",
        tasks=2, n=2, seed=0, policy="never", pool=["t0", "t1"], held_out=[],
        created_at=0.0,
    )  # fmt: skip
    return RunContext(
        opts=RunOptions(workload="math"), state=state, run_dir=tmp_path, node=NOTHING,
        workload=NOTHING, workload_name="math", dataset="", held_out=[], chat=NOTHING, specs=[],
        sandboxed=False, start_step=1, steps=10, deterministic=False, base_step=4,
    )  # fmt: skip


def lane(tail: EventTail, tmp_path: Path) -> TrainLane:
    return TrainLane(
        NOTHING, tail, NOTHING, "math", 0, NOTHING, checkpoint_dir=tmp_path, deterministic=False
    )


async def arrive(tail: EventTail, *events: EventBase) -> None:
    async with tail._changed:
        tail.events.extend(events)
        tail._changed.notify_all()


def train_step(step: int, ids: list[str]) -> TrainStep:
    zero = dict.fromkeys(
        ("loss", "reward_mean", "reward_std", "logprob_diff_max", "logprob_diff_mean",
         "clip_low", "clip_high", "kl", "grad_norm", "lr", "recompute_s", "train_s",
         "checkpoint_s", "push_s", "step_s"),
        0.0,
    )  # fmt: skip
    return TrainStep(
        step=step, version=step + 1, samples=len(ids), groups=2, tokens=8, unchecked_tokens=0,
        checkpointed=True, replay=False, trajectory_ids=ids, weights_sha256="ab", **cast(Any, zero),
    )  # fmt: skip
