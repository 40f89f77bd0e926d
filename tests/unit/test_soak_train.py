"""The soak's training lane waiting for a step (``bench/soak_train.py``): a trainer killed after
the step's checkpoint and before its ``train_step`` resumes past the step and never publishes
that event — the lane counts the step from the resume, with the trajectories of its durable
plan; a resume before the step's checkpoint is not enough (the replayed step's ``train_step``
is waited for). Events are handed to a real ``EventTail`` by hand (no bus)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from common.events import EventTail
from schemas.events import TrainerResumed, TrainStepStarted
from services.rl.records import Phases
from services.trainer import journal
from tests.unit.soak_train_helpers import arrive, context, lane, train_step


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
