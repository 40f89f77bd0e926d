"""The soak's training lane waiting for a step (``bench/soak_train.py``): a trainer killed after
the step's checkpoint and before its ``train_step`` resumes past the step and never publishes
that event — the lane counts the step from the resume, with the trajectories of its durable
plan; a resume before the step's checkpoint is not enough (the replayed step's ``train_step``
is waited for). Events are handed to a real ``EventTail`` by hand (no bus)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, cast

from bench.soak_train import TrainLane
from common.events import EventTail
from schemas.events import EventBase, TrainerResumed, TrainStep, TrainStepStarted
from services.rl.loop import RunContext
from services.rl.options import RunOptions, RunState
from services.rl.records import Phases
from services.trainer import journal

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


async def test_a_step_checkpointed_before_the_kill_is_counted_from_the_resume(
    tmp_path: Path,
) -> None:
    tail, ctx = EventTail(None), context(tmp_path)
    ids = ("soakrun-i1-s1-s0-a0", "soakrun-i1-s1-s1-a0")
    journal.write_plan(tmp_path, journal.Plan(5, 5, ids))
    t0 = time.time()
    waiting = asyncio.create_task(lane(tail, tmp_path)._trained(ctx, 1, Phases(), t0))
    started = TrainStepStarted(step=5, base_version=5, samples=2, replay=False)
    await arrive(tail, started, TrainerResumed(step=4, version=5, store_version=5, trained=8,
                                               replay_steps=1, pushed=False))  # fmt: skip
    await arrive(tail, TrainerResumed(step=5, version=6, store_version=6, trained=10,
                                      replay_steps=0, pushed=True))  # fmt: skip
    done = await asyncio.wait_for(waiting, 5.0)
    # the version of the resume at the step (a resume before its checkpoint does not end it)
    assert (done.step, done.via, done.version) == (5, "resume", 6)
    assert done.trajectory_ids == list(ids) and done.rollout == "soakrun-i1-s1"


async def test_the_step_s_own_event_is_taken_when_it_comes(tmp_path: Path) -> None:
    tail, ctx = EventTail(None), context(tmp_path)
    waiting = asyncio.create_task(lane(tail, tmp_path)._trained(ctx, 1, Phases(), time.time()))
    started = TrainStepStarted(step=5, base_version=5, samples=2, replay=False)
    await arrive(tail, started, train_step(5, ["a", "b"]))
    done = await asyncio.wait_for(waiting, 5.0)
    assert (done.step, done.via, done.trajectory_ids, done.weights_sha256) == (
        5, "event", ["a", "b"], "ab",
    )  # fmt: skip
