"""The controller on the bus: ``belayer.rollout.submit`` (validate a rollout request — workload,
tasks, policy, injections, images — then run it) and ``belayer.rollout.status``; at start it
adopts every rollout a previous incarnation left running, resuming each in-flight trajectory
from its durable ready prefix (KV ``trajectory_prefix``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from common import events, subjects
from common.codec import decode, encode
from common.errors import (
    BelayerError,
    BusUnavailable,
    Conflict,
    InvalidRequest,
    NotFound,
    Unauthorized,
)
from common.logging import get_logger
from common.service import Service, run_service
from common.tasks import keep
from model.chat import ChatFormat
from model.tokenizer import load_tokenizer
from schemas.events import RolloutStarted, TrajectoriesAdopted
from schemas.rollout import (
    RolloutAccepted,
    RolloutRequest,
    RolloutResult,
    RolloutState,
    RolloutStatusRequest,
    Trajectory,
    TrajectoryRow,
    TrajectoryState,
)
from services.controller.config import ControllerConfig
from services.controller.fault_actions import Injector
from services.controller.fault_specs import SANDBOX_KINDS, check_specs
from services.controller.policy import parse_policy
from services.controller.reward_service import ask_reward_service
from services.controller.rollout import RolloutRun
from services.controller.store import StateStore
from services.controller.summary import summarize
from services.environment.client import PlacedEnvClient
from workloads import plugins
from workloads.base import Outcome, Task, Workload
from workloads.registry import load_workload
from workloads.rewards import (
    RewardFunctions,
    check_weights,
    declared_rewards,
    load_reward_functions,
    service_name,
)
from workloads.table import dataset_workload

log = get_logger(service="controller")

MAX_ROLLOUT_ID = 64
"""Rollout ids leave room for the slot, attempt and generation suffixes of the ids made of them."""


def trajectory_id(rollout_id: str, slot: int, attempt: int) -> str:
    return f"{rollout_id}-s{slot}-a{attempt}"


def row_of(record: Trajectory) -> TrajectoryRow:
    """The status row of a published trajectory."""
    rec = record.recovery
    return TrajectoryRow(
        trajectory_id=record.trajectory_id, task_id=record.task_id, slot=record.slot,
        attempt=record.attempt, state="finished", finish_reason=record.finish_reason,
        reward=record.reward, turns=record.turns, restores=rec.restores,
        restarts_from_scratch=rec.restarts_from_scratch, checkpoints=rec.checkpoints,
        sandbox_failures=rec.sandbox_failures, detail=record.detail[:300],
        reward_error=record.reward_error,
    )  # fmt: skip


class Controller(Service[ControllerConfig]):
    """Rollouts in flight by id; each a ``RolloutRun`` task."""

    name = "controller"

    async def setup(self) -> None:
        cfg = self.config
        if not cfg.model_dir:
            raise InvalidRequest("the controller needs --model-dir (the node's model)")
        self.store = StateStore(self.nc, self.js)
        self.env = PlacedEnvClient(self.nc, timeout=cfg.env_timeout_s)
        self.injector = Injector(self.nc, self.env, docker_url=cfg.docker_url)
        tokenizer = await asyncio.to_thread(load_tokenizer, Path(cfg.model_dir))
        self.chat = ChatFormat(tokenizer)
        self.limit = asyncio.Semaphore(cfg.max_trajectories)
        self.runs: dict[str, RolloutRun] = {}
        self.mains: set[asyncio.Task[None]] = set()
        self.workloads: dict[tuple[str, str, str, str], Workload] = {}
        self.submit_lock = asyncio.Lock()
        await self.adopt_all()
        await self.server.serve(
            subjects.rollout_submit(), RolloutRequest, self.on_submit, concurrent=True
        )
        await self.server.serve(
            subjects.rollout_status(), RolloutStatusRequest, self.on_status, concurrent=True
        )

    async def drain(self) -> None:
        """Stop taking requests, then stop the rollouts: their durable state stays ``running``
        for the next incarnation to adopt."""
        await self.server.drain(timeout=self.drain_timeout_s)
        for task in list(self.mains):
            task.cancel()
        for run in self.runs.values():
            await run.stop()
        for task in list(self.mains):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def start(self, run: RolloutRun, adopted: dict[int, TrajectoryState]) -> None:
        self.runs[run.rollout_id] = run
        keep(
            self.mains,
            asyncio.create_task(self._main(run, adopted), name=f"rollout_{run.rollout_id}"),
        )

    async def _main(self, run: RolloutRun, adopted: dict[int, TrajectoryState]) -> None:
        try:
            await run.main(adopted)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in one rollout must not stop the controller
            log.exception("rollout_crashed", rollout_id=run.rollout_id)

    def make_run(self, state: RolloutState, tasks: list[Task], workload: Workload) -> RolloutRun:
        return RolloutRun(
            state=state, tasks=tasks, workload=workload, config=self.config, nc=self.nc,
            js=self.js, env=self.env, chat=self.chat, store=self.store, injector=self.injector,
            limit=self.limit, incarnation=state.incarnations,
        )  # fmt: skip

    # --- validation -----------------------------------------------------------------------
    async def workload_of(self, req: RolloutRequest) -> Workload:
        key = (req.workload, req.dataset, req.prompt_column, req.answer_column)
        if plugins.is_spec(req.workload) and req.workload not in self.config.workload_plugins:
            raise Unauthorized(
                "this node does not run that workload plugin: start the node with "
                "`belayer up --workload-plugin SPEC` (a request alone may not make the "
                "controller import code)",
                plugin=req.workload,
                field="$.workload",
                enabled=list(self.config.workload_plugins),
            )
        if key not in self.workloads:
            try:
                name, options = dataset_workload(
                    req.workload, req.dataset, req.prompt_column, req.answer_column
                )
                self.workloads[key] = await asyncio.to_thread(load_workload, name, **options)
            except BelayerError:
                raise
            except Exception as exc:  # a reader's own error on a bad file
                raise InvalidRequest(
                    f"cannot load workload {req.workload!r}: {exc}", field="$.dataset"
                ) from None
        base = self.workloads[key]
        if req.rewards:
            return self.rewarded(req.rewards, req.reward_weights, base)
        declared = declared_rewards(base)  # its own `rewards = ["service:<name>"]`
        return self.rewarded(declared, [], base) if declared else base

    def rewarded(self, specs: list[str], weights_given: list[float], base: Workload) -> Workload:
        """``base`` scored by reward functions and services, each function one the node
        enables."""
        off = [
            spec
            for spec in specs
            if spec not in self.config.reward_functions and not service_name(spec)
        ]
        if off:
            raise Unauthorized(
                "this node does not run that reward function: start the node with "
                "`belayer up --reward-function SPEC`",
                functions=off,
                field="$.rewards",
                enabled=list(self.config.reward_functions),
            )
        weights = check_weights(specs, weights_given)
        cfg, nc = self.config, self.nc

        async def ask(name: str, task: Task, outcome: Outcome) -> float | None:
            return await ask_reward_service(
                nc, name, task, outcome,
                timeout_s=cfg.reward_timeout_s, attempts=cfg.reward_attempts,
            )  # fmt: skip

        return RewardFunctions(base, load_reward_functions(specs), weights, ask)

    async def tasks_of(self, req: RolloutRequest, workload: Workload) -> list[Task]:
        if req.task_ids:
            return [workload.task(t) for t in req.task_ids]
        return await asyncio.to_thread(workload.tasks, req.tasks, req.seed)

    async def validate(self, req: RolloutRequest) -> tuple[Workload, list[Task]]:
        """Everything a rollout needs, checked before any sandbox starts."""
        try:
            parse_policy(req.policy)
        except ValueError as exc:
            raise InvalidRequest(str(exc), field="$.policy") from None
        workload = await self.workload_of(req)
        tasks = await self.tasks_of(req, workload)
        try:
            check_specs(req.inject, len(tasks) * req.n)
        except ValueError as exc:
            raise InvalidRequest(str(exc), field="$.inject") from None
        sandboxed = [t for t in tasks if t.sandbox is not None]
        if sandboxed and any(not service_name(s) for s in req.rewards):
            raise InvalidRequest(
                "reward functions score answer tasks; this workload's run in a sandbox "
                "(reward services may score them)",
                field="$.rewards",
            )
        if not sandboxed and any(s.kind in SANDBOX_KINDS for s in req.inject):
            raise InvalidRequest(
                f"workload {req.workload!r} runs no sandbox: nothing for a sandbox injection",
                field="$.inject",
            )
        if sandboxed:
            try:
                await self.env.list()
            except BusUnavailable:
                raise BusUnavailable(
                    "the environment service is not running (start the node with Docker usable, "
                    "or `belayer up --environment`)"
                ) from None
            from workloads.swe import require_image

            for image in sorted({t.sandbox.image for t in sandboxed if t.sandbox}):
                await asyncio.to_thread(require_image, image)
        return workload, tasks

    # --- handlers -------------------------------------------------------------------------
    async def on_submit(self, req: RolloutRequest, _msg: Msg) -> RolloutAccepted:
        rid = req.rollout_id or f"r{uuid.uuid4().hex[:12]}"
        if len(rid) > MAX_ROLLOUT_ID:
            raise InvalidRequest(f"rollout_id longer than {MAX_ROLLOUT_ID}", field="$.rollout_id")
        req = msgspec.structs.replace(req, rollout_id=rid)
        async with self.submit_lock:
            existing = (
                self.runs[rid].state if rid in self.runs else await self.store.get_rollout(rid)
            )
            if existing is not None:
                if encode(existing.request) != encode(req):
                    raise Conflict("rollout id reused with another request", field="$.rollout_id")
                return RolloutAccepted(
                    rollout_id=rid, trajectories=len(existing.task_ids) * req.n,
                    task_ids=existing.task_ids, existing=True,
                )  # fmt: skip
            workload, tasks = await self.validate(req)
            slots = len(tasks) * req.n
            state = RolloutState(
                request=req, task_ids=[t.id for t in tasks], accepted_at=time.time(),
                attempts=[0] * slots,
            )  # fmt: skip
            await self.store.put_rollout(rid, state)
            self.start(self.make_run(state, tasks, workload), {})
        await events.publish(
            self.js,
            RolloutStarted(
                rollout_id=rid, workload=req.workload, trajectories=slots, policy=req.policy
            ),
        )
        log.info("rollout_started", rollout_id=rid, workload=req.workload, trajectories=slots)
        return RolloutAccepted(rollout_id=rid, trajectories=slots, task_ids=state.task_ids)

    async def on_status(self, req: RolloutStatusRequest, _msg: Msg) -> RolloutResult:
        run = self.runs.get(req.rollout_id)
        if run is not None:
            return RolloutResult(
                rollout_id=run.rollout_id, state=run.state.state, summary=run.summary(),
                rows=run.all_rows(), workload=run.request.workload,
            )  # fmt: skip
        state = await self.store.get_rollout(req.rollout_id)
        if state is None:
            raise NotFound("unknown rollout", rollout_id=req.rollout_id)
        rows, logs = await self.history(state)
        summary = state.summary or summarize(
            state, len(state.task_ids) * state.request.n, rows.values(), logs, now=time.time()
        )
        return RolloutResult(
            rollout_id=req.rollout_id, state=state.state, summary=summary,
            rows=[rows[k] for k in sorted(rows)], workload=state.request.workload,
        )  # fmt: skip

    # --- adoption -------------------------------------------------------------------------
    async def history(
        self, state: RolloutState
    ) -> tuple[dict[tuple[int, int], TrajectoryRow], list[Any]]:
        rows: dict[tuple[int, int], TrajectoryRow] = {}
        logs: list[Any] = []
        rid = state.request.rollout_id
        for slot, last in enumerate(state.attempts):
            for attempt in range(last + 1):
                st = await self.store.get_trajectory(trajectory_id(rid, slot, attempt))
                if st is not None and st.row is not None:
                    rows[(slot, attempt)] = st.row
                    logs.append((st.recovery, st.timings))
        return rows, logs

    async def published(self, rollout_id: str, tid: str) -> Trajectory | None:
        """The trajectory as published to TRAJECTORIES, if it was."""
        try:
            msg = await self.js.get_last_msg(
                subjects.STREAM_TRAJECTORIES, subjects.trajectory(rollout_id, tid)
            )
        except nats.js.errors.NotFoundError:
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusUnavailable(f"cannot read TRAJECTORIES: {exc!r}") from None
        try:
            return decode(msg.data or b"", Trajectory)
        except BelayerError:
            return None

    async def adopt_all(self) -> None:
        for rid in await self.store.rollout_ids():
            state = await self.store.get_rollout(rid)
            if state is None or state.state != "running":
                continue
            try:
                await self.adopt(state)
            except BelayerError as exc:
                log.error("adopt_failed", rollout_id=rid, code=exc.code, error=str(exc))

    async def adopt(self, state: RolloutState) -> None:
        rid = state.request.rollout_id
        workload = await self.workload_of(state.request)
        tasks = [workload.task(t) for t in state.task_ids]
        state.incarnations += 1
        run = self.make_run(state, tasks, workload)
        adopted: dict[int, TrajectoryState] = {}
        for slot, last in enumerate(state.attempts):
            for attempt in range(last + 1):
                tid = trajectory_id(rid, slot, attempt)
                st = await self.store.get_trajectory(tid)
                if st is None:
                    continue
                if st.status != "running" and st.row is not None:
                    run.rows[(slot, attempt)] = st.row
                    run.logs[(slot, attempt)] = (st.recovery, st.timings)
                    continue
                record = await self.published(rid, tid)
                if record is not None:  # published just before the old controller died
                    row = row_of(record)
                    run.rows[(slot, attempt)] = row
                    run.logs[(slot, attempt)] = (record.recovery, record.timings)
                    st = msgspec.structs.replace(st, status="finished", row=row)
                    await self.store.put_trajectory(st)
                    continue
                adopted[slot] = st
        await run.adopted()
        await events.publish(
            self.js,
            TrajectoriesAdopted(
                rollout_id=rid,
                trajectory_ids=[a.trajectory_id for a in adopted.values()],
                incarnation=state.incarnations,
            ),
        )
        log.info("rollout_adopted", rollout_id=rid, trajectories=len(adopted))
        self.start(run, adopted)


async def run(
    config: ControllerConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Serve rollouts until ``stop`` (see ``Controller``)."""
    await run_service(Controller(config), stop=stop, ready=ready)
