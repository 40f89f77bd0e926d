"""The RL loop, top to bottom (as slime's ``train.py``): set up, then for every step one named
call per phase (``run_step``; ``belayer run`` and ``belayer bench train`` both drive it) —

    rollout  →  reward  →  train  →  push weights  →  eval

``rollout`` submits the step's tasks × n to the controller (with the step's injections) and
follows it; ``reward`` reads the published trajectories back from stream ``TRAJECTORIES`` (the
controller scored them) and samples a few for ``samples.jsonl``; ``train`` waits for the
trainer's update of that batch (``train_step``), SIGKILLing the trainer mid-update when asked;
``push weights`` waits until every engine generates with the new version; ``eval`` runs the
held-out tasks greedily (``held_out``). Each step's record (``records``) goes to
``metrics.jsonl`` and TensorBoard as it ends (``train_loop``); the report and plots are written
at the end (also after a failure).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from common.errors import BelayerError, BusUnavailable, Conflict, Timeout
from common.events import EventTail
from common.logging import get_logger
from model.chat import ChatFormat
from schemas.events import (
    EventBase,
    ShadowReady,
    TrainerResumed,
    TrainStep,
    TrainStepStarted,
    TrajectoryRefused,
)
from schemas.rollout import RolloutRequest, RolloutResult, Trajectory
from schemas.seeds import derive_seed
from schemas.serving import GenerateRequest, SamplingParams
from services.controller.client import submit, trajectories, wait
from services.rl.held_out import EvalResult, evaluate
from services.rl.node import NodeHandle, kill_process, supervisor_procs
from services.rl.options import RunOptions, RunState, StepFaults, faults_of, step_tasks
from services.rl.records import Batch, Phases, StepRecord, step0_record, step_record
from services.rl.report import RunLogs
from services.router.client import generate, router_status
from services.trainer.client import trainer_status
from workloads import Task, Workload

log = get_logger(component="run")

SAMPLES_PER_STEP = 4
"""Trajectories per step in ``samples.jsonl`` (those that went through recovery first)."""
TRAIN_START_S = 300.0
TRAIN_DONE_S = 900.0
SWITCH_S = 60.0


class Quiet:
    """Progress hooks that show nothing (a caller without a terminal: the benchmarks, the
    Python API)."""

    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def begin_step(self, step: int, steps: int) -> None:
        pass

    def phase(self, name: str, done: int, total: int) -> None:
        pass

    def end_step(self, record: dict[str, Any]) -> None:
        pass


@dataclass
class RunContext:
    """What the loop needs, decided before it starts."""

    opts: RunOptions
    state: RunState
    run_dir: Path
    node: NodeHandle
    workload: Workload
    workload_name: str
    dataset: str
    held_out: list[Task]
    chat: ChatFormat
    specs: list[Any]
    sandboxed: bool
    start_step: int
    steps: int
    deterministic: bool
    base_step: int = 0
    """The trainer's steps before this run's first (trainer step = base + run step)."""
    t0: float = field(default_factory=time.time)
    kills: list[dict[str, Any]] = field(default_factory=list)
    """The run's own injections: trainer and shadow kills, with their recoveries."""
    errors: list[str] = field(default_factory=list)
    events: EventTail | None = None
    """The run's event tail (set by ``train_loop``)."""
    rollout_seed: int | None = None
    """Every step's rollout seeded with this (benchmarks: the same content each step);
    None: ``derive_seed(seed, step)``."""
    failure_rate: float | None = None
    """λ for the rollouts' checkpoint policy (None: the controller estimates it)."""
    nc: Any = None
    """The bus connection the steps run over (set by ``train_loop``)."""
    ui: Any = field(default_factory=Quiet)
    """Progress hooks: ``phase(name, done, total)``, ``begin_step``, ``end_step``."""
    max_tokens: int = 256
    """Tokens per response of the step's rollouts."""
    eval_every: int = 1
    """Held-out evaluation after every this many steps and the last (``evaluates``)."""
    temperature: float = 1.0
    """Sampling temperature of the step's rollouts (held-out evaluation is greedy)."""
    max_turns: int | None = None
    """LLM turns per trajectory of the step's rollouts (None: the request's default)."""


# --- the loop -------------------------------------------------------------------------------
async def train_loop(nc: Any, ctx: RunContext, ui: Any) -> list[dict[str, Any]]:
    """Run steps ``start_step..steps``; returns this invocation's records (step 0 included
    when the run starts fresh)."""
    ctx.nc, ctx.ui = nc, ui
    events = await EventTail(nc).start(new_only=True)
    logs = RunLogs(ctx.run_dir)
    records: list[dict[str, Any]] = []
    ctx.events = events
    try:
        if ctx.start_step == 1:
            held = await eval_held_out(nc, ctx, 0, ui)
            records.append(step0_record(ctx, held))
            logs.step(records[-1], [])
        for step in range(ctx.start_step, ctx.steps + 1):
            ui.begin_step(step, ctx.steps)
            done = await run_step(ctx, step, faults_of(ctx.specs, step, sandboxed=ctx.sandboxed))
            records.append(done.line)
            logs.step(done.line, done.batch.samples)
            ui.end_step(done.line)
    finally:
        logs.close()
        await events.stop()
    return records


async def run_step(ctx: RunContext, step: int, faults: StepFaults) -> StepRecord:
    """One RL step over ``ctx.nc`` with the run's event tail ``ctx.events`` (started by the
    caller): rollout → reward → train → push weights → held-out eval, then the recovery of
    the step's own kills; its record."""
    nc, ui, events = ctx.nc, ctx.ui, ctx.events
    assert events is not None, "run_step follows the run's events: start ctx.events first"
    t_start, times = time.time(), Phases()
    result = await run_rollout(nc, ctx, step, faults, ui, times)
    batch = await collect_rewards(nc, ctx, result, ui, times)
    trained = await await_train_step(nc, events, ctx, step, faults, ui, times)
    await await_weights_switched(nc, ctx, trained.version, ui, times)
    held = await eval_held_out(nc, ctx, step, ui, times) if evaluates(ctx, step) else None
    await settle_kills(events, ctx, step)
    line = step_record(ctx, step, faults, result, batch, trained, held, times, events, t_start)
    return StepRecord(line, result, batch, trained, held, times)


# --- the phases -----------------------------------------------------------------------------
def rollout_id(ctx: RunContext, step: int) -> str:
    return f"{ctx.state.run_id}-i{ctx.state.incarnations}-s{step}"


def step_request(ctx: RunContext, step: int, faults: StepFaults) -> RolloutRequest:
    """The step's rollout request: its tasks × n, its injections."""
    st = ctx.state
    req = RolloutRequest(
        workload=ctx.workload_name,
        rollout_id=rollout_id(ctx, step),
        task_ids=step_tasks(st.pool, step, st.tasks),
        dataset=ctx.dataset,
        prompt_column=ctx.opts.prompt_column,
        answer_column=ctx.opts.answer_column,
        rewards=list(ctx.opts.rewards),
        reward_weights=list(ctx.opts.reward_weights),
        n=st.n,
        sampling=SamplingParams(temperature=ctx.temperature, max_tokens=ctx.max_tokens),
        seed=derive_seed(st.seed, step) if ctx.rollout_seed is None else ctx.rollout_seed,
        policy=st.policy,
        failure_rate=ctx.failure_rate,
        inject=faults.rollout,
    )
    if ctx.max_turns is not None:
        req = msgspec.structs.replace(req, max_turns=ctx.max_turns)
    return req


async def run_rollout(
    nc: Any, ctx: RunContext, step: int, faults: StepFaults, ui: Any, times: Phases
) -> RolloutResult:
    """The step's tasks × n through the controller, its injections with it."""
    t0 = time.monotonic()
    req = step_request(ctx, step, faults)
    accepted = await submit(nc, req)
    ui.phase("rollout", 0, accepted.trajectories)
    if faults.shadow_kill:
        await kill_shadow(nc, ctx, step, faults.shadow_kill)
    result = await wait(
        nc,
        accepted.rollout_id,
        timeout=3600.0,
        on_progress=lambda r: ui.phase(
            "rollout", r.summary.trajectories_completed, r.summary.trajectories
        ),
    )
    s = result.summary
    if s.trajectories_completed < s.trajectories:
        raise Conflict(
            f"step {step}: {s.trajectories - s.trajectories_completed} of {s.trajectories} "
            f"trajectories failed after {req.max_attempts} attempts each; an incomplete GRPO "
            "group cannot be trained",
            rollout_id=result.rollout_id,
        )
    times.rollout = time.monotonic() - t0
    return result


async def collect_rewards(
    nc: Any, ctx: RunContext, result: RolloutResult, ui: Any, times: Phases
) -> Batch:
    """Read the step's published trajectories back (scored by the controller)."""
    t0 = time.monotonic()
    trajs = await trajectories(nc, result.rollout_id, timeout=30.0)
    ui.phase("reward", len(trajs), result.summary.trajectories)
    rewards = [t.reward for t in trajs]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else 0.0
    chosen = sorted(trajs, key=lambda t: (not t.recovery.entries, t.slot))[:SAMPLES_PER_STEP]
    samples = [sample_of(ctx, t) for t in chosen]
    times.reward = time.monotonic() - t0
    return Batch(trajs, mean, std, sum(sum(t.loss_mask) for t in trajs), samples)


def sample_of(ctx: RunContext, t: Trajectory) -> dict[str, Any]:
    """One ``samples.jsonl`` row."""
    tok = ctx.chat.tokenizer
    return {
        "step": None,
        "trajectory_id": t.trajectory_id,
        "task_id": t.task_id,
        "sample": t.sample,
        "reward": t.reward,
        "finish_reason": t.finish_reason,
        "turns": t.turns,
        "prompt": tok.decode(t.prompt_ids, skip_special_tokens=False),
        "response": tok.decode(t.response_ids, skip_special_tokens=False),
        "actions": [a.command for a in t.actions],
        "recovery": [msgspec.structs.asdict(e) for e in t.recovery.entries],
        "weight_versions": sorted({v for v in t.weight_versions if v >= 0}),
    }


async def await_train_step(
    nc: Any,
    events: EventTail,
    ctx: RunContext,
    step: int,
    faults: StepFaults,
    ui: Any,
    times: Phases,
) -> TrainStep:
    """Wait for the trainer's update of this step's batch (killing the trainer mid-update when
    injected: the restarted trainer redoes the step from its plan)."""
    t0 = time.monotonic()
    target = ctx.base_step + step
    rid = rollout_id(ctx, step)
    ui.phase("train", 0, 3)

    def refused(e: EventBase) -> bool:
        return isinstance(e, TrajectoryRefused) and e.trajectory_id.startswith(f"{rid}-")

    def check(e: EventBase) -> bool:
        if refused(e):
            assert isinstance(e, TrajectoryRefused)
            raise Conflict(f"the trainer refused {e.trajectory_id} ({e.reason}: {e.detail})")
        return False

    started = await events.wait_until(
        lambda e: check(e) or (isinstance(e, TrainStepStarted) and e.step == target),
        TRAIN_START_S,
        f"train_step_started for step {target}",
    )
    ui.phase("train", 1, 3)
    if faults.trainer_kill:
        await kill_trainer(nc, events, ctx, step, faults.trainer_kill, started.ts)
        ui.phase("train", 2, 3)
    done = await events.wait_until(
        lambda e: check(e) or (isinstance(e, TrainStep) and e.step == target),
        TRAIN_DONE_S,
        f"train_step {target}",
    )
    assert isinstance(done, TrainStep)
    ui.phase("train", 3, 3)
    times.train = max(0.0, time.monotonic() - t0 - done.push_s)
    times.push = done.push_s
    if ctx.deterministic and done.logprob_diff_max > 0:
        ctx.errors.append(
            f"step {step}: logprob_diff_max {done.logprob_diff_max:.3g} in deterministic mode"
        )
    return done


async def await_weights_switched(
    nc: Any, ctx: RunContext, version: int, ui: Any, times: Phases
) -> None:
    """Until every engine generates with weight ``version`` or later (a one-token probe
    each)."""
    t0 = time.monotonic()
    deadline = t0 + SWITCH_S
    while True:
        try:
            status = await router_status(nc, timeout=5.0)
            break
        except (BusUnavailable, Timeout):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)  # the router is restarting: a bounded retry
    pending = {e.id for e in status.engines if e.state != "unhealthy"}
    ui.phase("push", 0, len(pending))
    probe = 0
    while pending:
        for engine_id in sorted(pending):
            probe += 1
            req = GenerateRequest(
                request_id=f"{ctx.state.run_id}-i{ctx.state.incarnations}-v{version}-"
                f"{engine_id}-{probe}",
                prompt_token_ids=ctx.chat.generation_header(),
                sampling=SamplingParams(temperature=0.0, max_tokens=1),
                stream=False,
                engine_id=engine_id,
            )
            try:
                result = await generate(nc, req, timeout=10.0)
                if result.weight_version >= version:
                    pending.discard(engine_id)
            except BelayerError as exc:  # the engine is coming back: probe again
                log.info("switch_probe_failed", engine_id=engine_id, error=str(exc))
        ui.phase("push", len(status.engines) - len(pending), len(status.engines))
        if pending:
            if time.monotonic() > deadline:
                raise Timeout(
                    f"engines {sorted(pending)} did not switch to version {version}",
                    timeout=SWITCH_S,
                )
            await asyncio.sleep(0.05)  # the workers switch at their next step boundary
    times.push += time.monotonic() - t0


def evaluates(ctx: RunContext, step: int) -> bool:
    """Whether the held-out tasks are evaluated after ``step``: every ``eval_every``-th step
    and the run's last (step 0, before training, always)."""
    return step % ctx.eval_every == 0 or step == ctx.steps


async def eval_held_out(
    nc: Any, ctx: RunContext, step: int, ui: Any, times: Phases | None = None
) -> EvalResult:
    """The held-out tasks, greedy, on the current weights."""
    done = [0]
    total = len(ctx.held_out)
    ui.phase("eval", 0, total)

    def tick() -> None:
        done[0] += 1
        ui.phase("eval", done[0], total)

    result = await evaluate(
        nc, ctx.workload, ctx.held_out, ctx.chat,
        tag=f"{ctx.state.run_id}-i{ctx.state.incarnations}-e{step}", on_done=tick,
    )  # fmt: skip
    ctx.errors += [f"step {step} eval: {e}" for e in result.errors]
    if times is not None:
        times.eval = result.seconds
    return result


# --- the run's own injections ------------------------------------------------------------
async def kill_trainer(
    nc: Any, events: EventTail, ctx: RunContext, step: int, text: str, started: float
) -> None:
    """SIGKILL the trainer during the update that just started; recovered once it resumed."""
    st = await trainer_status(nc, timeout=5.0)
    now = time.time()
    if not kill_process(st.pid, "services.trainer"):
        ctx.errors.append(f"{text}: the trainer (pid {st.pid}) is not a local process")
        return
    entry = {"injection": text, "kind": "trainer-kill", "step": step, "pid": st.pid,
             "t": now, "update_started": started, "recovered_t": None}  # fmt: skip
    ctx.kills.append(entry)
    log.warning("trainer_killed", pid=st.pid, step=step)
    resumed = await events.wait_until(
        lambda e: isinstance(e, TrainerResumed) and e.ts >= now, TRAIN_START_S, "trainer_resumed"
    )
    entry["recovered_t"] = resumed.ts
    entry["replay_steps"] = getattr(resumed, "replay_steps", 0)


async def kill_shadow(nc: Any, ctx: RunContext, step: int, text: str) -> None:
    """SIGKILL the first engine's shadow while the rollout runs; recovered at its successor's
    ``shadow_ready`` (``settle_kills``)."""
    procs = await supervisor_procs(nc)
    shadows = sorted(n for n, (pid, alive) in procs.items() if n.startswith("shadow-") and alive)
    if not shadows:
        ctx.errors.append(f"{text}: no live shadow (baseline node?)")
        return
    name = shadows[0]
    pid = procs[name][0]
    now = time.time()
    if not kill_process(pid, "--role=shadow"):
        ctx.errors.append(f"{text}: {name} (pid {pid}) is not a local process")
        return
    ctx.kills.append({"injection": text, "kind": "shadow-kill", "step": step, "pid": pid,
                      "engine_id": name.removeprefix("shadow-"), "t": now,
                      "recovered_t": None})  # fmt: skip
    log.warning("shadow_killed", pid=pid, engine=name, step=step)


def shadow_replaced(kill: dict[str, Any]) -> Callable[[EventBase], bool]:
    """Matches the ``shadow_ready`` of the shadow that replaced the one ``kill`` killed (its
    engine, another pid, after the kill)."""

    def match(e: EventBase) -> bool:
        return (
            isinstance(e, ShadowReady)
            and e.engine_id == kill["engine_id"]
            and e.pid != kill["pid"]
            and e.ts >= kill["t"]
        )

    return match


async def settle_kills(events: EventTail, ctx: RunContext, step: int) -> None:
    """Wait (bounded) for the recovery of this step's shadow kills."""
    for k in ctx.kills:
        if k["step"] != step or k["kind"] != "shadow-kill" or k["recovered_t"]:
            continue
        try:
            ready = await events.wait_until(
                shadow_replaced(k), 60.0, f"shadow_ready after {k['injection']}"
            )
            k["recovered_t"] = ready.ts
        except Timeout as exc:
            ctx.errors.append(f"{k['injection']}: {exc}")
