"""``belayer soak --train``'s training lane: real RL steps back to back, each the RL loop's own
phases (``services/rl/loop.py``: rollout through the controller → rewards read back → the
trainer's update → every engine on the new weights), while the schedule's faults land —
``trainer-kill`` among them.

Every step goes to the history (``bench/soak_train_check.py``): its rollout and every
trajectory it published (as the rollout lane's, so ``trajectories`` covers them), the step
the trainer finished with the trajectories it trained, the weights' version and sha256, every
``trainer_resumed``, and every step that failed. The trainer of a node the soak starts trains
``TRAIN_TASKS`` × ``TRAIN_SAMPLES`` a step at learning rate ``TRAIN_LR``: the update's work is
all done but the weights do not move, so the generate requests' fault-free references (run
after the soak, on the last weights) still hold.

A trainer killed after a step's checkpoint and before its ``train_step`` event resumes *past*
the step (its checkpoint holds it) and has nothing to redo; it publishes the step's
``train_step`` again from the checkpoint (``republished``), right after its
``trainer_resumed``. The lane waits for either: the step's ``train_step`` (the first of the
step: a republished duplicate of a step whose event did arrive, or of an earlier step, is not
another lane step's), or a ``trainer_resumed`` at or past the step — a trainer of an older
release republishes nothing —, then takes the step's trajectories from its durable plan and its
version from the resume. Either way the step is recorded once and the lane goes on. Each lane
step also reads the trainer's step first (``wait_trainer``), so the lane's count never drifts
from the trainer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from bench import soak_check as sc
from bench import soak_work as sw
from common.errors import BelayerError
from common.events import EventTail
from schemas.events import TrainerResumed
from schemas.rollout import RolloutResult, Trajectory
from services.controller.client import trajectories
from services.rl.lane import lane_context
from services.rl.loop import (
    TRAIN_DONE_S,
    Quiet,
    RunContext,
    await_train_step,
    await_weights_switched,
    collect_rewards,
    rollout_id,
    run_rollout,
    step_request,
)
from services.rl.node import NodeHandle, run_trainer_config, wait_trainer
from services.rl.options import StepFaults
from services.rl.records import Phases
from services.trainer import journal
from services.trainer.client import TrainerConfig

TRAIN_TASKS = 2
TRAIN_SAMPLES = 2
"""A step of the soak's trainer: 2 tasks × 2 samples (GRPO groups of 2)."""
TRAIN_LR = 1e-12
"""The soak's trainer's peak learning rate: negligible, so the load does not drift."""
MAX_TOKENS = 48
MAX_TURNS = 2
"""The lane's rollouts: short responses (swe: 2 turns), as the rollout lane's."""
TRAINER_WAIT_S = 120.0
"""How long a lane step waits for the trainer to answer, idle (it may be restarting)."""
ERROR_PAUSE_S = 0.5
"""Pause after a failed lane step (a failure that repeats does not spin)."""


def trainer_config(checkpoint_dir: Path, seed: int) -> TrainerConfig:
    """The trainer of a node ``belayer soak --train`` starts (``belayer run``'s, with the
    soak's group shape and learning rate)."""
    return run_trainer_config(
        group_size=TRAIN_SAMPLES, groups_per_step=TRAIN_TASKS, checkpoint_dir=checkpoint_dir,
        seed=seed, lr=TRAIN_LR,
    )  # fmt: skip


class TrainLane:
    """RL steps back to back until stopped; each recorded."""

    def __init__(
        self,
        nc: Any,
        events: EventTail,
        node: NodeHandle,
        workload: str,
        seed: int,
        history: Any,
        *,
        checkpoint_dir: Path | None,
        deterministic: bool,
    ) -> None:
        self.nc, self.events, self.node, self.history = nc, events, node, history
        self.workload, self.seed = workload, seed
        self.checkpoint_dir = checkpoint_dir
        """The trainer's checkpoints and plans (None: not known, a node of the user's)."""
        self.deterministic = deterministic
        self._resumes: set[tuple[float, int]] = set()

    async def run(self, stop: asyncio.Event) -> int:
        """Steps until ``stop`` (the step in flight is finished); how many trained. A trainer
        that never answers is the lane's error (``train_error`` of step 0), as any step's."""
        step = trained = 0
        try:
            ctx = await self._start()
            while not stop.is_set():
                step += 1
                try:
                    trained += await self.step(ctx, step)
                except BelayerError as exc:
                    self._error(ctx, step, f"{exc.code}: {exc}")
                    await asyncio.sleep(ERROR_PAUSE_S)  # a bounded pause, not synchronisation
                self._record_resumes()
        except BelayerError as exc:  # the lane could not start
            self.history.write(sc.TrainError(step=0, t=time.time(), error=f"{exc.code}: {exc}"))
        finally:
            self._record_resumes()
            self.history.write(sc.TrainLaneEnded(t=time.time(), steps=trained))
        return trained

    async def _start(self) -> RunContext:
        """The lane's context, once the trainer answers (its group shape is the lane's)."""
        st = await wait_trainer(self.nc, TRAINER_WAIT_S)
        ctx = lane_context(
            self.node, self.workload, tasks=st.batch_size // st.group_size, n=st.group_size,
            seed=self.seed, policy="never", run_dir=self.node.paths.root / "soak-train",
            deterministic=self.deterministic, max_tokens=MAX_TOKENS, max_turns=MAX_TURNS,
        )  # fmt: skip
        ctx.nc, ctx.events = self.nc, self.events
        self.history.write(
            sc.TrainLane(
                t=time.time(), workload=self.workload, tasks=ctx.state.tasks, n=ctx.state.n,
                base_step=st.step,
            )
        )  # fmt: skip
        return ctx

    async def step(self, ctx: RunContext, step: int) -> int:
        """One RL step: rollout → rewards → the trainer's update → every engine on its
        weights; 1 when the trainer trained it."""
        st = await wait_trainer(self.nc, TRAINER_WAIT_S)
        ctx.base_step = st.step - step + 1  # the trainer's next step is this lane step's
        times, t0 = Phases(), time.time()
        try:
            result = await self._rollout(ctx, step, times)
        except BelayerError:
            await self._published(ctx, step, t0, None)
            raise
        batch = await collect_rewards(self.nc, ctx, result, Quiet(), times)
        self._write_rollout(ctx, step, t0, result, batch.trajectories)
        done = await self._trained(ctx, step, times, t0)
        self.history.write(done)
        for error in ctx.errors:  # the loop's own findings (a log-prob difference)
            self._error(ctx, step, error)
        ctx.errors.clear()
        await await_weights_switched(self.nc, ctx, done.version, Quiet(), times)
        return 1

    async def _rollout(self, ctx: RunContext, step: int, times: Phases) -> RolloutResult:
        """The step's rollout (``run_rollout``), its request first submitted through controller
        restarts (``run_rollout``'s own submission then finds it accepted: idempotent);
        following it rides through a restart already."""
        await sw.submit_through_restarts(self.nc, step_request(ctx, step, StepFaults()))
        return await run_rollout(self.nc, ctx, step, StepFaults(), Quiet(), times)

    async def _trained(self, ctx: RunContext, step: int, times: Phases, t0: float) -> sc.Trained:
        """The trainer's update of the step's batch: its ``train_step`` (original or
        republished), or a ``trainer_resumed`` at or past the step (the module doc), whichever
        comes first: one record of the step."""
        target, rid = ctx.base_step + step, rollout_id(ctx, step)
        train = asyncio.ensure_future(
            await_train_step(self.nc, self.events, ctx, step, StepFaults(), Quiet(), times)
        )
        resumed = asyncio.ensure_future(
            self.events.wait_until(
                lambda e: isinstance(e, TrainerResumed) and e.step >= target and e.ts >= t0,
                TRAIN_DONE_S,
                f"trainer_resumed at step {target}",
            )
        )
        try:
            await asyncio.wait({train, resumed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (train, resumed):
                f.cancel()
        if train.done() and not train.cancelled():
            ev = train.result()  # its error, if it failed
            return sc.Trained(
                step=ev.step, rollout=rid, trajectory_ids=list(ev.trajectory_ids),
                version=ev.version, t=time.time(), weights_sha256=ev.weights_sha256,
                via="republished" if ev.republished else "event",
            )  # fmt: skip
        r = resumed.result()
        assert isinstance(r, TrainerResumed)
        return sc.Trained(
            step=target, rollout=rid, trajectory_ids=self._planned(target), version=r.version,
            t=time.time(), via="resume",
        )  # fmt: skip

    def _planned(self, step: int) -> list[str]:
        """The trajectories of ``step``'s durable plan (empty: not readable)."""
        if self.checkpoint_dir is None:
            return []
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            plan = journal.read_plan(journal.plan_path(self.checkpoint_dir, step))
            return list(plan.trajectory_ids)
        return []

    def _write_rollout(
        self,
        ctx: RunContext,
        step: int,
        t0: float,
        result: RolloutResult | None,
        published: list[Trajectory],
    ) -> None:
        rid = rollout_id(ctx, step)
        slots = result.summary.trajectories if result else ctx.state.tasks * ctx.state.n
        self.history.write(sc.RolloutSubmitted(rid=rid, t=t0, workload=self.workload, slots=slots))
        for t in published:
            self.history.write(
                sc.TrajectorySeen(
                    rollout=rid, trajectory_id=t.trajectory_id, slot=t.slot, attempt=t.attempt,
                    t=time.time(),
                )
            )  # fmt: skip
        s = result.summary if result else None
        self.history.write(
            sc.RolloutEnded(
                rid=rid, t=time.time(), completed=s.trajectories_completed if s else 0,
                slots_failed=s.slots_failed if s else 0,
                error="" if result else "the step's rollout failed",
            )
        )  # fmt: skip

    async def _published(
        self, ctx: RunContext, step: int, t0: float, result: RolloutResult | None
    ) -> None:
        """A failed rollout: what it published still goes to the history (the trainer may
        train it)."""
        published: list[Trajectory] = []
        with contextlib.suppress(BelayerError):
            published = await trajectories(self.nc, rollout_id(ctx, step), timeout=10.0)
        self._write_rollout(ctx, step, t0, result, published)

    def _error(self, ctx: RunContext, step: int, error: str) -> None:
        self.history.write(
            sc.TrainError(
                step=step, t=time.time(), error=error[:500], rollout=rollout_id(ctx, step)
            )
        )

    def _record_resumes(self) -> None:
        for e in self.events.matching(TrainerResumed):
            key = (e.ts, e.step)
            if key not in self._resumes:
                self._resumes.add(key)
                self.history.write(
                    sc.TrainerResumedSeen(
                        step=e.step, version=e.version, trained=e.trained,
                        replay_steps=e.replay_steps, t=e.ts,
                    )
                )  # fmt: skip
