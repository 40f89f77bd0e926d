"""One trajectory attempt on the bus: the agent loop around ``core.TrajectoryCore``.

Per turn: the next response from the router (streamed, with log-probabilities) → the action it
asks for → wait until a checkpoint of the previous boundary is ready or failed (action
execution and checkpoint creation exclude each other; the wait is the *visible* checkpoint
cost) → ``exec`` in the sandbox → the observation → the policy's decision; a ``full_checkpoint``
then runs concurrently with the next LLM request (the bubble).

An infrastructure failure (the container died or hangs, the exec transport broke, the
environment service timed out or is restarting) never becomes an observation: ``recover``
restores the latest ready checkpoint C_j into a fresh container and truncates the context to
exactly L_j, falls back to older checkpoints and then to a fresh sandbox with L_0, within a
retry budget; exhausted, the attempt ends ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common import subjects
from common.codec import encode
from common.errors import (
    BelayerError,
    BusUnavailable,
    Conflict,
    ResourceLimit,
    RewardFailed,
    SandboxError,
    Timeout,
)
from common.logging import get_logger
from model.chat import ChatFormat
from schemas.env import EnvExecResult
from schemas.events import (
    EventBase,
    SandboxFailure,
    TrajectoryFailed,
    TrajectoryFinished,
    TrajectoryRestored,
)
from schemas.rollout import RolloutRequest, Trajectory, TrajectoryRow, TrajectoryState
from schemas.seeds import derive_seed
from schemas.serving import GenerateRequest, GenerateResult, TokenDelta
from services.controller.config import ControllerConfig
from services.controller.core import (
    Again,
    Execute,
    Finish,
    Generate,
    Limits,
    Pending,
    Score,
    TrajectoryCore,
    is_agent_timeout,
)
from services.controller.policy import CheckpointPolicy, PolicyConfig, PolicyStats
from services.controller.store import StateStore
from services.environment.client import EnvClient
from services.router.client import generate as router_generate
from workloads.actions import sandbox_command
from workloads.base import ResponseText, SandboxHandle, Task, Workload

log = get_logger(component="trajectory")

TRANSPORT_CODES = frozenset({"bus_unavailable", "timeout", "checkpoint_busy"})
"""Errors of the path to the environment service, not of the checkpoint being restored."""


class RolloutHooks(Protocol):
    """What an attempt calls back into its rollout for: the fault injections drawn around each
    environment step, a worker kill armed for the next response, and the rollout's events and
    recovery counts (``rollout.RolloutRun`` implements it)."""

    async def before_step(self, runner: TrajectoryRunner) -> None: ...

    async def after_action(self, runner: TrajectoryRunner) -> None: ...

    def kill_worker(self, text: str, runner: TrajectoryRunner | None) -> None: ...

    async def event(self, event: EventBase, msg_id: str | None = None) -> None: ...

    async def recovered(self, text: str, trajectory_id: str, seconds: float) -> None: ...


@dataclass(frozen=True)
class AttemptContext:
    """Everything an attempt reads of its rollout, and nothing else: the request and settings,
    the handles it talks through, and the ``hooks`` back into the rollout. The runner gets
    this, not the ``RolloutRun``, so it cannot reach the rollout's own state (its rows, its
    live runners, its injection bookkeeping)."""

    rollout_id: str
    request: RolloutRequest
    config: ControllerConfig
    policy_config: PolicyConfig
    stats: PolicyStats
    """Shared by every attempt of the rollout (the risk-aware policy learns from all)."""
    incarnation: int
    chat: ChatFormat
    workload: Workload
    nc: NATS
    js: JetStreamContext
    env: EnvClient
    store: StateStore
    hooks: RolloutHooks


class TrajectoryRunner:
    """Runs attempt ``attempt`` of ``slot``; ``adopted`` is its durable state when a restarted
    controller takes it over (resumed from the latest ready prefix)."""

    def __init__(
        self,
        ctx: AttemptContext,
        slot: int,
        attempt: int,
        task: Task,
        adopted: TrajectoryState | None = None,
    ) -> None:
        self.ctx = ctx
        self.slot, self.attempt, self.task = slot, attempt, task
        self.trajectory_id = f"{ctx.rollout_id}-s{slot}-a{attempt}"
        self.sample = slot % ctx.request.n
        self.env = ctx.env
        self.log = log.bind(trajectory_id=self.trajectory_id)
        self.reward_error = ""
        """Why the reward functions failed on this trajectory (``RewardFailed``)."""
        req, cfg = ctx.request, ctx.config
        limits = task.limits
        self.core = TrajectoryCore(
            trajectory_id=self.trajectory_id,
            prompt_ids=ctx.chat.prompt((m.role, m.content) for m in task.prompt),
            limits=Limits(
                max_turns=min(req.max_turns, limits.max_turns),
                max_invalid_in_row=cfg.max_invalid_in_row,
                max_prompt_tokens=cfg.max_prompt_tokens,
                max_context_tokens=cfg.max_context_tokens,
                max_response_tokens=min(req.sampling.max_tokens, limits.max_response_tokens),
                observation_chars=limits.observation_chars,
                action_timeout_s=limits.action_timeout_s,
                deadline_s=req.deadline_s,
                vocab_size=ctx.chat.tokenizer.vocab_size,
            ),
            policy=CheckpointPolicy(
                ctx.policy_config, ctx.stats, image=task.sandbox.image if task.sandbox else ""
            ),
            sample_seed=derive_seed(req.seed, self.sample),
            has_sandbox=task.sandbox is not None,
            started_at=time.time(),
            observation_ids=ctx.chat.observation,
        )
        self.sandbox_id = ""
        self.fired: list[str] = []
        self.waiting: list[tuple[str, float]] = []
        """Injected sandbox failures not yet recovered: (spec text, monotonic time)."""
        self.arm_worker_kill: list[str] = []
        self.pending: asyncio.Task[None] | None = None
        self.adopted = adopted
        if adopted is not None:
            self._load(adopted)

    def _load(self, st: TrajectoryState) -> None:
        c = self.core
        c.response_ids, c.loss_mask = list(st.response_ids), list(st.loss_mask)
        c.logprobs, c.weight_versions = list(st.logprobs), list(st.weight_versions)
        c.actions, c.ready = list(st.actions), list(st.ready)
        c.turn = st.ready[-1].turn if st.ready else 0
        c.generations, c.env_steps = st.generations, st.env_steps
        c.recovery, c.timings = st.recovery, st.timings
        c.started_at = st.started_at or c.started_at
        self.sandbox_id, self.fired = st.sandbox_id, list(st.fired)

    # --- the attempt ----------------------------------------------------------------------
    async def execute(self) -> TrajectoryRow:
        """Run to the end; returns the attempt's row (its trajectory is published unless it
        ended ``failed``)."""
        core = self.core
        try:
            await self.persist()
            if self.task.sandbox is not None:
                if self.adopted is not None:
                    core.log("adopted", time.time(), f"incarnation {self.ctx.incarnation}")
                    await self.recover("adopt", None)
                else:
                    await self.recover("create", None)
            while core.finish is None:
                await self.turn()
        except BelayerError as exc:
            self.log.warning("trajectory_error", code=exc.code, error=str(exc))
            core.fail(f"{exc.code}: {exc}")
        except Exception as exc:  # a bug must end this attempt, not the rollout
            self.log.exception("trajectory_crashed")
            core.fail(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            await self.cancel_checkpoint()
        return await self.end()

    async def turn(self) -> None:
        core = self.core
        step = core.next_generation(time.time())
        if isinstance(step, Finish):
            return
        if isinstance(step, Score):
            await self.score(step)
            return
        result = await self.generate(step)
        if result is None:
            return
        action = core.on_response(
            result.token_ids,
            result.logprobs,
            result.token_weight_versions,
            result.text,
            llm_s=self.last_llm_s,
            resumes=result.resumes,
            now=time.time(),
        )
        if isinstance(action, Again | Finish):
            return
        if isinstance(action, Execute):
            await self.act(action)
        elif isinstance(action, Score):
            await self.score(action)

    async def generate(self, step: Generate) -> GenerateResult | None:
        req = self.ctx.request
        sampling = msgspec.structs.replace(req.sampling, seed=step.seed, max_tokens=step.max_tokens)
        gen = GenerateRequest(
            request_id=step.request_id, prompt_token_ids=step.prompt_ids, sampling=sampling
        )
        left = self.core.started_at + req.deadline_s - time.time()
        first = True

        def on_delta(_d: TokenDelta) -> None:
            nonlocal first
            if first and self.arm_worker_kill:
                self.ctx.hooks.kill_worker(self.arm_worker_kill.pop(0), self)
            first = False

        t0 = time.monotonic()
        try:
            result = await router_generate(
                self.ctx.nc, gen, timeout=max(left, 0.1), on_delta=on_delta
            )
        except Timeout:
            self.core.stop(Finish("deadline", "no response before the deadline"))
            return None
        except ResourceLimit as exc:
            self.core.stop(Finish("length", str(exc)))
            return None
        except Conflict:  # a restarted controller reused a request id with another prompt
            self.core.generations += 1000
            return None
        self.last_llm_s = time.monotonic() - t0
        return result

    last_llm_s: float = 0.0

    async def act(self, action: Execute) -> None:
        core = self.core
        await self.settle_checkpoint()
        await self.ctx.hooks.before_step(self)
        spec = self.task.sandbox
        assert spec is not None
        t0 = time.monotonic()
        try:
            out: EnvExecResult | None = await self.env.exec(
                self.sandbox_id,
                sandbox_command(spec.workdir, action.command),
                timeout_s=core.limits.action_timeout_s,
            )
        except BelayerError as exc:
            if not is_agent_timeout(exc.code, exc.message, exc.data):
                await self.recover("exec", exc)
                return
            out = None
            try:  # the agent's own timeout, or is the sandbox hanging?
                await self.env.exec(
                    self.sandbox_id, "true", timeout_s=self.ctx.config.probe_timeout_s
                )
            except BelayerError as probe:
                await self.recover("probe", probe)
                return
            tail = str(exc.data.get("stdout_tail", ""))
        env_s = time.monotonic() - t0
        if out is None:
            core.on_observation(stdout=tail, stderr="", exit_code=-1, env_s=env_s, timed_out=True)
        else:
            core.on_observation(
                stdout=out.stdout,
                stderr=out.stderr,
                exit_code=out.exit_code,
                env_s=env_s,
                truncated=out.truncated,
            )
        await self.ctx.hooks.after_action(self)
        _, pending = core.decide_checkpoint(step_s=env_s, now=time.time())
        if pending is not None and self.sandbox_id:
            self.pending = asyncio.create_task(self.checkpoint(pending, self.sandbox_id))

    async def score(self, action: Score) -> None:
        core = self.core
        await self.settle_checkpoint()
        t0 = time.monotonic()
        try:
            ids = tuple(t for t, m in zip(core.response_ids, core.loss_mask, strict=True) if m)
            if self.task.sandbox is None:
                text = ResponseText(action.text, token_ids=ids, trajectory_id=self.trajectory_id)
                reward = await self.ctx.workload.reward(self.task, text)
            else:
                handle = SandboxHandle(
                    ops=self.env, sandbox_id=self.sandbox_id, trajectory_id=self.trajectory_id,
                    response=action.text, token_ids=ids,
                )  # fmt: skip
                reward = await self.ctx.workload.reward(self.task, handle)
        except RewardFailed as exc:
            # The user's reward function, not the infrastructure: a typed record on the
            # trajectory (its reward means nothing; the trainer leaves it out), never a retry.
            self.reward_error = str(exc)[:300]
            self.log.warning("reward_failed", error=self.reward_error)
            core.finished(action.reason, action.detail, 0.0)
            return
        except BelayerError as exc:
            if exc.code == "invalid_request" or self.task.sandbox is None:
                core.fail(f"scoring failed: {exc}")
                return
            await self.recover("reward", exc)
            return
        core.timings.reward_s += time.monotonic() - t0
        core.finished(action.reason, action.detail, float(reward))

    # --- checkpoints ----------------------------------------------------------------------
    async def checkpoint(self, pending: Pending, sandbox_id: str) -> None:
        cfg = self.ctx.config
        t0 = time.monotonic()
        try:
            info = await self.env.checkpoint(
                sandbox_id, pending.prefix, self.trajectory_id, timeout_s=cfg.checkpoint_timeout_s
            )
        except BelayerError as exc:
            timed_out = isinstance(exc, Timeout)
            self.core.on_checkpoint_failed(
                pending, f"{exc.code}: {exc}"[:300], timed_out=timed_out,
                seconds=time.monotonic() - t0, now=time.time(),
            )  # fmt: skip
            return
        ready = self.core.on_checkpoint_ready(
            pending, info.checkpoint_id, time.monotonic() - t0, time.time()
        )
        del self.core.ready[: -cfg.keep_ready]
        self.log.info("checkpoint_ready", prefix=ready.prefix, checkpoint_id=ready.checkpoint_id)
        await self.persist()

    async def settle_checkpoint(self) -> None:
        """Wait until the pending checkpoint is ready or failed (the action must not run
        meanwhile); the wait counts as visible checkpoint time."""
        if self.pending is None:
            return
        t0 = time.monotonic()
        with contextlib.suppress(asyncio.CancelledError):
            await self.pending
        self.pending = None
        self.core.on_checkpoint_wait(time.monotonic() - t0)

    async def cancel_checkpoint(self) -> None:
        if self.pending is None:
            return
        self.pending.cancel()
        with contextlib.suppress(asyncio.CancelledError, BelayerError):
            await self.pending
        self.pending = None

    # --- recovery -------------------------------------------------------------------------
    async def recover(self, during: str, exc: BelayerError | None) -> None:
        """Bring the sandbox back to the latest ready prefix (or a fresh one for ``create`` /
        no checkpoint) with the context truncated to match; within the retry budget."""
        core, cfg = self.core, self.ctx.config
        t0 = time.monotonic()
        had_checkpoint = bool(core.ready)
        if exc is not None:
            core.on_sandbox_failure(during, exc.code, str(exc), time.time())
            await self.ctx.hooks.event(
                SandboxFailure(
                    rollout_id=self.ctx.rollout_id, trajectory_id=self.trajectory_id,
                    sandbox_id=self.sandbox_id, prefix=core.prefix, during=during,
                    code=exc.code, error=str(exc)[:500],
                )
            )  # fmt: skip
        await self.cancel_checkpoint()
        delay, last = cfg.recovery_backoff_s, "none"
        for _ in range(cfg.recovery_attempts):
            if time.time() - core.started_at >= core.limits.deadline_s:
                core.stop(Finish("deadline", f"recovering after {during}"))
                return
            candidate = core.restore_candidate() if self.sandbox_id else None
            try:
                if candidate is not None:
                    spec = self.task.sandbox
                    restored = await self.env.restore(
                        self.sandbox_id, candidate.checkpoint_id, image=spec.image if spec else "",
                        limits=spec.limits if spec else None, trajectory_id=self.trajectory_id,
                    )  # fmt: skip
                    if restored.prefix != candidate.prefix:
                        raise SandboxError("restored another prefix", prefix=restored.prefix)
                    core.on_restored(candidate, time.monotonic() - t0, time.time())
                else:
                    await self.fresh_sandbox()
                    if during != "create":
                        core.on_restarted_from_scratch(
                            time.monotonic() - t0, time.time(), had_checkpoint=had_checkpoint
                        )
            except BelayerError as err:
                last = f"{err.code}: {err}"
                if err.code == "invalid_request":
                    core.fail(f"{during}: {last}")
                    return
                if candidate is not None and err.code not in TRANSPORT_CODES:
                    core.on_restore_failed(candidate, last, time.time())
                    continue
                await asyncio.sleep(delay)  # the environment service may be restarting
                delay = min(delay * 2, cfg.recovery_backoff_max_s)
                continue
            if during != "create":
                await self.restored(t0, candidate is None)
            await self.persist()
            return
        core.fail(f"recovery after {during} gave up after {cfg.recovery_attempts} tries: {last}")

    async def restored(self, t0: float, from_scratch: bool) -> None:
        core = self.core
        ready = core.ready[-1] if core.ready and not from_scratch else None
        await self.ctx.hooks.event(
            TrajectoryRestored(
                rollout_id=self.ctx.rollout_id, trajectory_id=self.trajectory_id,
                sandbox_id=self.sandbox_id, prefix=core.prefix,
                checkpoint_id=ready.checkpoint_id if ready else "",
                context_tokens=len(core.context), seconds=round(time.monotonic() - t0, 4),
                from_scratch=from_scratch,
            )
        )  # fmt: skip
        for text, at in self.waiting:
            await self.ctx.hooks.recovered(text, self.trajectory_id, time.monotonic() - at)
        self.waiting.clear()

    async def fresh_sandbox(self) -> None:
        """A new sandbox from the task's image with its files and setup (the old one goes)."""
        spec = self.task.sandbox
        assert spec is not None
        if self.sandbox_id:
            with contextlib.suppress(BelayerError):
                await self.env.destroy(self.sandbox_id)
        created = await self.env.create(
            image=spec.image,
            files=spec.absolute_files(),
            limits=spec.limits,
            trajectory_id=self.trajectory_id,
            sandbox_id=f"{self.trajectory_id}-{secrets.token_hex(3)}",
        )
        self.sandbox_id = created.sandbox_id
        await self.persist()
        if spec.setup:
            r = await self.env.exec(
                self.sandbox_id,
                sandbox_command(spec.workdir, spec.setup),
                timeout_s=spec.setup_timeout_s,
            )
            if r.exit_code != 0:
                raise SandboxError(
                    "task setup failed", exit_code=r.exit_code, stderr=r.stderr[-300:]
                )

    # --- durable state and the end ----------------------------------------------------------
    def state(self, status: str = "running", row: TrajectoryRow | None = None) -> TrajectoryState:
        """The durable association: arrays cut to L_k of the latest ready checkpoint."""
        c = self.core
        top = c.ready[-1] if c.ready else None
        n = top.response_len if top else 0
        return TrajectoryState(
            trajectory_id=self.trajectory_id, rollout_id=self.ctx.rollout_id, slot=self.slot,
            attempt=self.attempt, status=status,  # type: ignore[arg-type]  # a TrajectoryStatus value
            sandbox_id=self.sandbox_id, ready=list(c.ready), response_ids=c.response_ids[:n],
            loss_mask=c.loss_mask[:n], logprobs=c.logprobs[:n], weight_versions=c.weight_versions[:n],
            actions=c.actions[: top.actions_len if top else 0], generations=c.generations,
            recovery=c.recovery, timings=c.timings, fired=list(self.fired), row=row,
            started_at=c.started_at, env_steps=c.env_steps,
        )  # fmt: skip

    async def persist(self) -> None:
        try:
            await self.ctx.store.put_trajectory(self.state())
        except BelayerError as exc:  # the next write catches up; recovery only loses progress
            self.log.warning("state_write_failed", error=str(exc))

    def row(self) -> TrajectoryRow:
        c = self.core
        f = c.finish
        failed = f is None or f.reason == "failed"
        return TrajectoryRow(
            trajectory_id=self.trajectory_id, task_id=self.task.id, slot=self.slot,
            attempt=self.attempt, state="failed" if failed else "finished",
            finish_reason=f.reason if f else "failed", reward=f.reward if f else 0.0,
            turns=c.turn, restores=c.recovery.restores,
            restarts_from_scratch=c.recovery.restarts_from_scratch,
            checkpoints=c.recovery.checkpoints, sandbox_failures=c.recovery.sandbox_failures,
            detail=(f.detail if f else "")[:300], reward_error=self.reward_error,
        )  # fmt: skip

    def record(self) -> Trajectory:
        c, f = self.core, self.core.finish
        assert f is not None
        return Trajectory(
            trajectory_id=self.trajectory_id, rollout_id=self.ctx.rollout_id,
            workload=self.ctx.request.workload, task_id=self.task.id, slot=self.slot,
            sample=self.sample, attempt=self.attempt, prompt_ids=c.prompt_ids,
            response_ids=c.response_ids, loss_mask=c.loss_mask, logprobs=c.logprobs,
            weight_versions=c.weight_versions, reward=f.reward, turns=c.turn,
            finish_reason=f.reason, actions=c.actions, timings=c.timings, recovery=c.recovery,
            seed=c.sample_seed, policy=c.policy.config.name, detail=f.detail,
            temperature=self.ctx.request.sampling.temperature, reward_error=self.reward_error,
        )  # fmt: skip

    async def end(self) -> TrajectoryRow:
        self.core.timings.total_s = time.time() - self.core.started_at
        row = self.row()
        rid = self.ctx.rollout_id
        if row.state == "finished":
            try:
                await self.publish(self.record())
            except BelayerError as exc:
                self.core.fail(f"could not publish the trajectory: {exc}")
                row = self.row()
        if row.state == "finished":
            await self.ctx.hooks.event(
                TrajectoryFinished(
                    rollout_id=rid, trajectory_id=self.trajectory_id,
                    finish_reason=row.finish_reason or "", reward=row.reward, turns=row.turns,
                )
            )  # fmt: skip
        else:
            retry = self.attempt + 1 < self.ctx.request.max_attempts
            await self.ctx.hooks.event(
                TrajectoryFailed(
                    rollout_id=rid, trajectory_id=self.trajectory_id,
                    reason=row.detail, retry=retry,
                )
            )  # fmt: skip
        self.log.info(
            "trajectory_end",
            state=row.state,
            finish_reason=row.finish_reason,
            reward=row.reward,
            detail=row.detail[:200] if row.state == "failed" else "",
        )
        try:
            await self.ctx.store.put_trajectory(self.state(row.state, row))
        except BelayerError as exc:
            self.log.warning("state_write_failed", error=str(exc))
        if self.sandbox_id:
            with contextlib.suppress(BelayerError):
                await self.env.destroy(self.sandbox_id)
        return row

    async def publish(self, record: Trajectory) -> None:
        """Into TRAJECTORIES with the trajectory id as ``Nats-Msg-Id`` (a retry or a
        re-publication by a restarted controller is dropped by the server)."""
        subject = subjects.trajectory(self.ctx.rollout_id, self.trajectory_id)
        deadline = time.monotonic() + self.ctx.config.publish_timeout_s
        delay = 0.2
        while True:
            try:
                await self.ctx.js.publish(
                    subject,
                    encode(record),
                    headers={"Nats-Msg-Id": self.trajectory_id},
                    timeout=5.0,
                )
                return
            except Exception as exc:  # nats errors or a timeout: retried until the deadline
                if time.monotonic() + delay > deadline:
                    raise BusUnavailable(f"publish failed: {exc!r}") from None
                self.log.warning("publish_retry", error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)  # bounded backoff while the stream fails over
                delay = min(delay * 2, 2.0)
