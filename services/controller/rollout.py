"""One rollout: its slots (task × sample), the attempts of each, the injections, the counts.

Every slot runs attempts until one is published; an attempt that ends ``failed`` is replaced
by a fresh one (up to ``max_attempts``), so GRPO groups stay full. The rollout's progress is
durable in KV ``rollouts`` (which attempt each slot is on, injections fired and counted) and
each attempt's in ``trajectory_prefix``, so a restarted controller picks up where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common import events
from common.errors import BelayerError
from common.logging import get_logger
from common.tasks import keep
from model.chat import ChatFormat
from schemas.events import EventBase, FailureInjected, FailureRecovered, RolloutDone
from schemas.rollout import (
    FaultSpec,
    RecoveryLog,
    RolloutState,
    RolloutSummary,
    Timings,
    TrajectoryRow,
    TrajectoryState,
)
from services.controller.config import ControllerConfig
from services.controller.fault_actions import Injector
from services.controller.fault_specs import (
    SANDBOX_KINDS,
    fires_at_step,
    fires_at_turn,
    spec_key,
)
from services.controller.policy import PolicyConfig, PolicyStats, parse_policy
from services.controller.runner import AttemptContext, TrajectoryRunner
from services.controller.store import StateStore
from services.controller.summary import summarize
from services.environment.client import EnvClient
from workloads.base import Task, Workload

log = get_logger(component="rollout")


class RolloutRun:
    """Runs one rollout to its end (or until the controller stops)."""

    def __init__(
        self,
        *,
        state: RolloutState,
        tasks: list[Task],
        workload: Workload,
        config: ControllerConfig,
        nc: NATS,
        js: JetStreamContext,
        env: EnvClient,
        chat: ChatFormat,
        store: StateStore,
        injector: Injector,
        limit: asyncio.Semaphore,
        incarnation: int = 1,
    ) -> None:
        self.state = state
        self.request = state.request
        self.rollout_id = state.request.rollout_id
        self.tasks, self.config = tasks, config
        self.store, self.injector = store, injector
        self.js = js
        self.global_limit = limit
        self.local_limit = asyncio.Semaphore(self.request.concurrency or config.default_concurrency)
        kind, interval = parse_policy(self.request.policy)
        # The policy is not told what is injected: it estimates λ from the failures it sees,
        # unless the request hands it an oracle probability (benchmarks compare the two).
        self.policy_config: PolicyConfig = dataclasses.replace(
            config.policy,
            kind=kind,
            interval=interval,
            failure_rate=self.request.failure_rate,
            fixed_probability=self.request.failure_probability,
        )
        self.stats = PolicyStats(self.policy_config)
        self.context = AttemptContext(
            rollout_id=self.rollout_id, request=self.request, config=config,
            policy_config=self.policy_config, stats=self.stats, incarnation=incarnation,
            chat=chat, workload=workload, nc=nc, js=js, env=env, store=store, hooks=self,
        )  # fmt: skip
        """What each attempt gets of this rollout (``runner.AttemptContext``)."""
        self.rows: dict[tuple[int, int], TrajectoryRow] = {}
        self.logs: dict[tuple[int, int], tuple[RecoveryLog, Timings]] = {}
        self.live: dict[int, TrajectoryRunner] = {}
        self.tasks_bg: set[asyncio.Task[Any]] = set()
        self.injections: set[asyncio.Task[Any]] = set()
        """Worker kills waiting for their engine to come back."""
        self.done = asyncio.Event()
        self.log = log.bind(rollout_id=self.rollout_id)

    @property
    def slots(self) -> int:
        return len(self.state.task_ids) * self.request.n

    def task_of(self, slot: int) -> Task:
        return self.tasks[slot // self.request.n]

    # --- running ------------------------------------------------------------------------
    async def main(self, adopted: dict[int, TrajectoryState]) -> None:
        timers = [
            self.spawn(self.timer(i, spec))
            for i, spec in enumerate(self.request.inject)
            if spec.trigger == "s"
        ]
        try:
            await asyncio.gather(
                *(self.run_slot(slot, adopted.get(slot)) for slot in range(self.slots))
            )
        finally:
            for t in timers:
                t.cancel()
        if self.injections:  # a killed worker's engine coming back is part of the rollout
            await asyncio.wait(set(self.injections), timeout=self.config.recovery_wait_s)
        await self.finish()

    async def run_slot(self, slot: int, adopted: TrajectoryState | None) -> None:
        attempt = self.state.attempts[slot]
        while attempt < self.request.max_attempts:
            if (slot, attempt) in self.rows:  # ended before a controller restart
                if self.rows[(slot, attempt)].state == "finished":
                    return
                attempt += 1
                continue
            self.state.attempts[slot] = attempt
            async with self.local_limit, self.global_limit:
                runner = TrajectoryRunner(self.context, slot, attempt, self.task_of(slot), adopted)
                self.live[slot] = runner
                try:
                    row = await runner.execute()
                finally:
                    self.live.pop(slot, None)
            self.rows[(slot, attempt)] = row
            self.logs[(slot, attempt)] = (runner.core.recovery, runner.core.timings)
            if row.state == "finished":
                return
            attempt, adopted = attempt + 1, None
            if attempt < self.request.max_attempts:
                self.state.attempts[slot] = attempt
                await self.save()

    async def finish(self) -> None:
        self.state.state = "done"
        self.state.finished_at = time.time()
        s = self.summary()
        self.state.summary = s
        await self.save()
        await self.event(
            RolloutDone(
                rollout_id=self.rollout_id,
                trajectories_completed=s.trajectories_completed,
                trajectories_failed=s.trajectories_failed,
                env_failures=s.env_failures,
                env_restores=s.env_restores,
                restarts_from_scratch=s.restarts_from_scratch,
                checkpoints=s.checkpoints,
                failures_injected=s.failures_injected,
                failures_recovered=s.failures_recovered,
                rollout_s=s.rollout_s,
                mean_reward=s.mean_reward,
            ),
            msg_id=f"rollout_done-{self.rollout_id}",
        )
        self.log.info("rollout_done", **msgspec.structs.asdict(s))
        self.done.set()

    def summary(self) -> RolloutSummary:
        return summarize(
            self.state, self.slots, self.all_rows(), self.all_logs(), now=time.time(),
            stats=self.stats,
        )  # fmt: skip

    def all_rows(self) -> list[TrajectoryRow]:
        rows = dict(self.rows)
        for slot, runner in self.live.items():
            rows[(slot, runner.attempt)] = msgspec.structs.replace(runner.row(), state="running")
        return [rows[k] for k in sorted(rows)]

    def all_logs(self) -> list[tuple[RecoveryLog, Timings]]:
        logs = dict(self.logs)
        for slot, runner in self.live.items():
            logs[(slot, runner.attempt)] = (runner.core.recovery, runner.core.timings)
        return list(logs.values())

    # --- shared helpers -----------------------------------------------------------------
    async def save(self) -> None:
        try:
            await self.store.put_rollout(self.rollout_id, self.state)
        except BelayerError as exc:
            self.log.warning("rollout_state_write_failed", error=str(exc))

    async def event(self, event: EventBase, msg_id: str | None = None) -> None:
        await events.publish(self.js, event, msg_id=msg_id)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return keep(self.tasks_bg, asyncio.create_task(coro))

    async def stop(self) -> None:
        for t in list(self.tasks_bg):
            t.cancel()
        for t in list(self.tasks_bg):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # --- injections -----------------------------------------------------------------------
    async def before_step(self, runner: TrajectoryRunner) -> None:
        """``p`` injections, drawn at the start of each environment step (numbered over the
        attempt, so a step run again after a restore draws afresh)."""
        step = runner.core.begin_step()
        for i, spec in enumerate(self.request.inject):
            if fires_at_step(
                spec, seed=self.request.seed, slot=runner.slot, attempt=runner.attempt,
                step=step, index=i,
            ):  # fmt: skip
                await self.inject(i, spec, runner)

    async def after_action(self, runner: TrajectoryRunner) -> None:
        """``turn`` injections, right after the T-th action."""
        for i, spec in enumerate(self.request.inject):
            if fires_at_turn(spec, runner.slot, len(runner.core.actions)):
                await self.inject(i, spec, runner)

    async def inject(self, index: int, spec: FaultSpec, runner: TrajectoryRunner | None) -> None:
        key = spec_key(index, spec)
        if spec.kind in SANDBOX_KINDS:
            if runner is None or not runner.sandbox_id:
                return
            if spec.trigger == "turn":
                if key in runner.fired:
                    return
                runner.fired.append(key)
                await runner.persist()
            try:
                cid = await self.injector.sandbox(spec.kind, runner.sandbox_id)
            except BelayerError as exc:
                self.log.warning("injection_failed", injection=spec.text, error=str(exc))
                return
            runner.core.log("injected", time.time(), spec.text)
            runner.waiting.append((spec.text, time.monotonic()))
            await self.injected(spec, runner.trajectory_id, cid[:12])
            return
        if key in self.state.fired:  # process kinds: once per rollout
            return
        self.state.fired.append(key)
        if spec.kind == "worker-kill":
            await self.save()
            if runner is not None and spec.trigger != "s":
                runner.arm_worker_kill.append(spec.text)  # at the next response's first token
            else:
                self.kill_worker(spec.text, runner)
        elif spec.kind == "controller-kill":
            self.state.failures_injected += 1
            self.state.pending_recovery.append(f"{time.time()}|{spec.text}")
            await self.save()
            await self.event(
                FailureInjected(
                    rollout_id=self.rollout_id, injection=spec.text, fault=spec.kind,
                    trajectory_id=runner.trajectory_id if runner else "", target="controller",
                )
            )  # fmt: skip
            self.injector.kill_self()

    def kill_worker(self, text: str, runner: TrajectoryRunner | None) -> None:
        keep(self.injections, self.spawn(self.fire_worker_kill(text, runner)))

    async def fire_worker_kill(self, text: str, runner: TrajectoryRunner | None) -> None:
        try:
            engine_id, pid = await self.injector.kill_worker()
        except BelayerError as exc:
            self.log.warning("injection_failed", injection=text, error=str(exc))
            return
        t0 = time.monotonic()
        traj = runner.trajectory_id if runner else ""
        await self.injected_text(text, "worker-kill", traj, f"pid {pid} ({engine_id})")
        if await self.injector.wait_engine_back(engine_id, pid, self.config.recovery_wait_s):
            await self.recovered(text, traj, time.monotonic() - t0)

    async def injected(self, spec: FaultSpec, trajectory_id: str, target: str) -> None:
        await self.injected_text(spec.text, spec.kind, trajectory_id, target)

    async def injected_text(self, text: str, kind: str, trajectory_id: str, target: str) -> None:
        self.state.failures_injected += 1
        await self.save()
        self.log.warning(
            "failure_injected", injection=text, trajectory_id=trajectory_id, target=target
        )
        await self.event(
            FailureInjected(
                rollout_id=self.rollout_id, injection=text, fault=kind,
                trajectory_id=trajectory_id, target=target,
            )
        )  # fmt: skip

    async def recovered(self, text: str, trajectory_id: str, seconds: float) -> None:
        self.state.failures_recovered += 1
        await self.save()
        await self.event(
            FailureRecovered(
                rollout_id=self.rollout_id, injection=text, trajectory_id=trajectory_id,
                seconds=round(seconds, 4),
            )
        )  # fmt: skip

    async def timer(self, index: int, spec: FaultSpec) -> None:
        """An ``s=SECONDS`` injection: once, that long after the rollout was accepted."""
        key = spec_key(index, spec)
        if key in self.state.fired:
            return
        await asyncio.sleep(max(0.0, self.state.accepted_at + spec.value - time.time()))
        if spec.kind in SANDBOX_KINDS:
            while True:  # the first trajectory with a sandbox at or after that time
                live = [r for _, r in sorted(self.live.items()) if r.sandbox_id]
                if live:
                    break
                await asyncio.sleep(0.05)  # bounded by the rollout: the timer is cancelled with it
            self.state.fired.append(key)
            await self.save()
            await self.inject(index, msgspec.structs.replace(spec, trigger="s"), live[0])
            return
        await self.inject(index, spec, None)

    async def adopted(self) -> None:
        """A restarted controller took this rollout over: the controller kills it was injected
        with are recovered."""
        for entry in self.state.pending_recovery:
            at, _, text = entry.partition("|")
            await self.recovered(text, "", max(0.0, time.time() - float(at or 0)))
        self.state.pending_recovery = []
        await self.save()
