"""The training loop of ``belayer run``, top to bottom (as slime's ``train.py``): set up, then
for every step one named call per phase —

    rollout  →  reward  →  train  →  push weights  →  eval

``rollout`` submits the step's tasks × n to the controller (with the step's injections) and
follows it; ``reward`` reads the published trajectories back from stream ``TRAJECTORIES`` (the
controller scored them) and samples a few for ``samples.jsonl``; ``train`` waits for the
trainer's update of that batch (``train_step``), SIGKILLing the trainer mid-update when asked;
``push weights`` waits until every engine generates with the new version; ``eval`` runs the
held-out tasks greedily (``run_eval``). Each step's record goes to ``metrics.jsonl`` and
TensorBoard as it ends; the report and plots are written at the end (also after a failure).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from common.errors import BelayerError, Conflict, Timeout
from common.logging import get_logger
from model.chat import ChatFormat
from schemas.events import (
    EventBase,
    FailureInjected,
    FailureRecovered,
    HandoverComplete,
    LogprobMismatch,
    ServiceRestarted,
    ShadowReady,
    TrainerCheckpointed,
    TrainerResumed,
    TrainStep,
    TrainStepStarted,
    TrajectoryRefused,
    TrajectoryRestored,
)
from schemas.rollout import RolloutRequest, RolloutResult, Trajectory
from schemas.seeds import derive_seed
from schemas.serving import GenerateRequest, SamplingParams
from services.cli.run_counters import compared_nothing, exact_share, lost_slots
from services.cli.run_eval import EvalResult, evaluate
from services.cli.run_node import EventTail, NodeHandle, kill_process, supervisor_procs
from services.cli.run_report import RunLogs
from services.cli.run_setup import RunOptions, RunState, StepFaults, faults_of, step_tasks
from services.controller.client import submit, trajectories, wait
from services.router.client import generate, router_status
from services.trainer.client import trainer_status
from workloads import Task, Workload

log = get_logger(component="run")

SAMPLES_PER_STEP = 4
"""Trajectories per step in ``samples.jsonl`` (those that went through recovery first)."""
TRAIN_START_S = 300.0
TRAIN_DONE_S = 900.0
SWITCH_S = 60.0


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


@dataclass
class Phases:
    """Seconds per phase of one step."""

    rollout: float = 0.0
    reward: float = 0.0
    train: float = 0.0
    push: float = 0.0
    eval: float = 0.0


# --- the loop -------------------------------------------------------------------------------
async def train_loop(nc: Any, ctx: RunContext, ui: Any) -> list[dict[str, Any]]:
    """Run steps ``start_step..steps``; returns this invocation's records (step 0 included
    when the run starts fresh)."""
    events = await EventTail(nc).start()
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
            faults = faults_of(ctx.specs, step, sandboxed=ctx.sandboxed)
            t_start, times = time.time(), Phases()
            result = await run_rollout(nc, ctx, step, faults, ui, times)
            batch = await collect_rewards(nc, ctx, result, ui, times)
            trained = await await_train_step(nc, events, ctx, step, faults, ui, times)
            await await_weights_switched(nc, ctx, trained, ui, times)
            held = await eval_held_out(nc, ctx, step, ui, times)
            await settle_kills(events, ctx, step)
            record = step_record(ctx, step, result, batch, trained, held, times, events, t_start)
            records.append(record)
            logs.step(record, batch.samples)
            ui.end_step(record)
    finally:
        logs.close()
        await events.stop()
    return records


# --- the phases -----------------------------------------------------------------------------
def rollout_id(ctx: RunContext, step: int) -> str:
    return f"{ctx.state.run_id}-i{ctx.state.incarnations}-s{step}"


async def run_rollout(
    nc: Any, ctx: RunContext, step: int, faults: StepFaults, ui: Any, times: Phases
) -> RolloutResult:
    """The step's tasks × n through the controller, its injections with it."""
    t0 = time.monotonic()
    st = ctx.state
    req = RolloutRequest(
        workload=ctx.workload_name,
        rollout_id=rollout_id(ctx, step),
        task_ids=step_tasks(st.pool, step, st.tasks),
        dataset=ctx.dataset,
        n=st.n,
        sampling=SamplingParams(temperature=ctx.opts.temperature, max_tokens=256),
        seed=derive_seed(st.seed, step) if ctx.rollout_seed is None else ctx.rollout_seed,
        policy=st.policy,
        failure_rate=ctx.failure_rate,
        inject=faults.rollout,
    )
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


@dataclass
class Batch:
    """The step's trajectories as the trainer gets them."""

    trajectories: list[Trajectory]
    reward_mean: float
    reward_std: float
    model_tokens: int
    samples: list[dict[str, Any]]


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

    started = await events.wait_for(
        lambda e: check(e) or (isinstance(e, TrainStepStarted) and e.step == target),
        TRAIN_START_S,
        f"train_step_started for step {target}",
    )
    ui.phase("train", 1, 3)
    if faults.trainer_kill:
        await kill_trainer(nc, events, ctx, step, faults.trainer_kill, started.ts)
        ui.phase("train", 2, 3)
    done = await events.wait_for(
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
    nc: Any, ctx: RunContext, trained: TrainStep, ui: Any, times: Phases
) -> None:
    """Until every engine generates with the pushed version (a one-token probe each)."""
    t0 = time.monotonic()
    deadline = t0 + SWITCH_S
    status = await router_status(nc, timeout=5.0)
    pending = {e.id for e in status.engines if e.state != "unhealthy"}
    ui.phase("push", 0, len(pending))
    probe = 0
    while pending:
        for engine_id in sorted(pending):
            probe += 1
            req = GenerateRequest(
                request_id=f"{ctx.state.run_id}-i{ctx.state.incarnations}-v{trained.version}-"
                f"{engine_id}-{probe}",
                prompt_token_ids=ctx.chat.generation_header(),
                sampling=SamplingParams(temperature=0.0, max_tokens=1),
                stream=False,
                engine_id=engine_id,
            )
            try:
                result = await generate(nc, req, timeout=10.0)
                if result.weight_version >= trained.version:
                    pending.discard(engine_id)
            except BelayerError as exc:  # the engine is coming back: probe again
                log.info("switch_probe_failed", engine_id=engine_id, error=str(exc))
        ui.phase("push", len(status.engines) - len(pending), len(status.engines))
        if pending:
            if time.monotonic() > deadline:
                raise Timeout(
                    f"engines {sorted(pending)} did not switch to version {trained.version}",
                    timeout=SWITCH_S,
                )
            await asyncio.sleep(0.05)  # the workers switch at their next step boundary
    times.push += time.monotonic() - t0


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
    resumed = await events.wait_for(
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
    if not kill_process(pid, "services.shadow"):
        ctx.errors.append(f"{text}: {name} (pid {pid}) is not a local process")
        return
    ctx.kills.append({"injection": text, "kind": "shadow-kill", "step": step, "pid": pid,
                      "engine_id": name.removeprefix("shadow-"), "t": now,
                      "recovered_t": None})  # fmt: skip
    log.warning("shadow_killed", pid=pid, engine=name, step=step)


async def settle_kills(events: EventTail, ctx: RunContext, step: int) -> None:
    """Wait (bounded) for the recovery of this step's shadow kills."""
    for k in ctx.kills:
        if k["step"] != step or k["kind"] != "shadow-kill" or k["recovered_t"]:
            continue
        try:
            ready = await events.wait_for(
                lambda e, k=k: (
                    isinstance(e, ShadowReady)  # type: ignore[misc]  # a lambda with a default argument
                    and e.engine_id == k["engine_id"]
                    and e.pid != k["pid"]
                    and e.ts >= k["t"]
                ),
                60.0,
                f"shadow_ready after {k['injection']}",
            )
            k["recovered_t"] = ready.ts
        except Timeout as exc:
            ctx.errors.append(f"{k['injection']}: {exc}")


# --- records --------------------------------------------------------------------------------
def step0_record(ctx: RunContext, held: EvalResult) -> dict[str, Any]:
    return {
        "step": 0,
        "run_id": ctx.state.run_id,
        "heldout_reward": round(held.mean, 4),
        "heldout_exact": _rounded(held.exact_mean),
        "heldout_rewards": held.rewards,
        "eval_s": round(held.seconds, 3),
        "weight_version": min(held.versions) if held.versions else None,
        "ts": time.time(),
    }


def step_record(
    ctx: RunContext,
    step: int,
    result: RolloutResult,
    batch: Batch,
    trained: TrainStep,
    held: EvalResult,
    times: Phases,
    events: EventTail,
    t_start: float,
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line."""
    s = result.summary
    rid = result.rollout_id
    own = [k for k in ctx.kills if k["step"] == step]
    handovers = len(events.of(HandoverComplete, after=t_start))
    for sample in batch.samples:
        sample["step"] = step
    slots = len(step_tasks(ctx.state.pool, step, ctx.state.tasks)) * ctx.state.n
    lost = lost_slots(slots, batch.trajectories, set(trained.trajectory_ids))
    compared = trained.logprob_tokens_compared
    if (error := compared_nothing(step, compared)) is not None:
        ctx.errors.append(error)
    return {
        "step": step,
        "rollout_id": rid,
        "weight_version": trained.version,
        "reward_mean": round(batch.reward_mean, 4),
        "reward_std": round(batch.reward_std, 4),
        "reward_exact": _rounded(exact_share(ctx.workload, batch.trajectories, ctx.chat.tokenizer)),
        "heldout_reward": round(held.mean, 4),
        "heldout_exact": _rounded(held.exact_mean),
        "heldout_rewards": held.rewards,
        "tokens": trained.tokens,
        "trajectories": s.trajectories,
        "trajectories_completed": s.trajectories_completed,
        "trajectories_trained": trained.samples,
        "trajectories_lost": len(lost),
        "slots_lost": lost,
        "attempts_failed": s.trajectories_failed,
        "loss": trained.loss,
        "grad_norm": trained.grad_norm,
        "clip_low": trained.clip_low,
        "clip_high": trained.clip_high,
        "kl": trained.kl,
        "lr": trained.lr,
        "logprob_diff_max": trained.logprob_diff_max if compared else None,
        "logprob_diff_mean": trained.logprob_diff_mean if compared else None,
        "logprob_tokens_compared": compared,
        "weights_sha256": trained.weights_sha256,
        "batch_sha256": trained.batch_sha256,
        "rewards": [t.reward for t in sorted(batch.trajectories, key=lambda t: t.slot)],
        "rollout_s": round(times.rollout, 3),
        "reward_s": round(times.reward, 3),
        "train_s": round(times.train, 3),
        "push_s": round(times.push, 3),
        "eval_s": round(times.eval, 3),
        "step_s": round(time.time() - t_start, 3),
        "trainer_step_s": trained.step_s,
        "failures_injected": s.failures_injected + len(own),
        "failures_recovered": s.failures_recovered + sum(1 for k in own if k["recovered_t"]),
        "env_failures": s.env_failures,
        "env_restores": s.env_restores,
        "restarts_from_scratch": s.restarts_from_scratch,
        "env_checkpoints": s.checkpoints,
        "visible_checkpoint_s": s.visible_checkpoint_s,
        "handovers": handovers,
        "trainer_restarts": len(events.of(TrainerResumed, after=t_start)),
        "replay": trained.replay,
        "inject": [f.text for f in faults_of(ctx.specs, step, sandboxed=ctx.sandboxed).rollout]
        + [k["injection"] for k in own],
        "t_start": round(t_start - ctx.t0, 3),
        "t_end": round(time.time() - ctx.t0, 3),
        "ts": time.time(),
    }


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def timeline(ctx: RunContext, events: EventTail, rollout_ids: set[str]) -> list[dict[str, Any]]:
    """Injected failures and recoveries, seconds into the run (for the plot and the report)."""
    out: list[dict[str, Any]] = []

    def add(t: float, typ: str, what: str, detail: str = "") -> None:
        out.append({"t": round(t - ctx.t0, 3), "type": typ, "what": what, "detail": detail})

    for e in events.events:
        if isinstance(e, FailureInjected) and e.rollout_id in rollout_ids:
            add(e.ts, "injected", f"{e.fault} injected", e.injection)
        elif isinstance(e, FailureRecovered) and e.rollout_id in rollout_ids:
            add(e.ts, "recovered", f"{e.injection.split('@')[0]} recovered", e.injection)
        elif isinstance(e, HandoverComplete):
            add(e.ts, "recovered", "handover complete", e.engine_id)
        elif isinstance(e, TrajectoryRestored) and e.rollout_id in rollout_ids:
            add(e.ts, "recovered", "sandbox restored" if not e.from_scratch else
                "sandbox restarted", e.trajectory_id)  # fmt: skip
        elif isinstance(e, TrainerResumed):
            add(e.ts, "recovered", "trainer resumed", f"step {e.step}, replay {e.replay_steps}")
        elif isinstance(e, ServiceRestarted):
            add(e.ts, "recovered", "service restarted", e.name)
        elif isinstance(e, LogprobMismatch):
            add(e.ts, "injected", "logprob mismatch", f"step {e.step}")
    for k in ctx.kills:
        add(k["t"], "injected", f"{k['kind']} injected", k["injection"])
    return sorted(out, key=lambda x: x["t"])


def totals(ctx: RunContext, records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """The run's report (the ``--json`` contract and more)."""
    events = ctx.events
    assert events is not None
    steps = [r for r in records if r.get("step", 0) >= 1]
    held = [r for r in records if "heldout_reward" in r]
    rollout_ids = {r["rollout_id"] for r in steps}
    for e in events.of(LogprobMismatch):
        ctx.errors.append(f"logprob_mismatch at step {e.step}: {e.logprob_diff_max:.3g}")
    fired = {e.injection for e in events.of(FailureInjected) if e.rollout_id in rollout_ids}
    fired |= {k["injection"] for k in ctx.kills}
    for s in ctx.specs:
        if s.trigger == "step" and int(s.value) <= (steps[-1]["step"] if steps else 0):
            if int(s.value) >= ctx.start_step and s.text not in fired:
                ctx.errors.append(f"{s.text} did not fire")
    return {
        "steps": len(steps),
        "trajectories_completed": sum(r["trajectories_completed"] for r in steps),
        "trajectories_lost": sum(r["trajectories_lost"] for r in steps),
        "failures_injected": sum(r["failures_injected"] for r in steps),
        "failures_recovered": sum(r["failures_recovered"] for r in steps),
        "env_restores": sum(r["env_restores"] for r in steps),
        "handovers": sum(r["handovers"] for r in steps),
        "trainer_restarts": len(events.of(TrainerResumed)),
        "checkpoints": len(events.of(TrainerCheckpointed)),
        "weight_version": steps[-1]["weight_version"] if steps else None,
        "reward_first_step": steps[0]["reward_mean"] if steps else None,
        "reward_last_step": steps[-1]["reward_mean"] if steps else None,
        "logprob_diff_max": max(
            (r["logprob_diff_max"] for r in steps if r["logprob_diff_max"] is not None),
            default=None,
        ),
        "logprob_tokens_compared": sum(r.get("logprob_tokens_compared", 0) for r in steps),
        "wall_seconds": round(wall, 2),
        "weights_sha256": steps[-1].get("weights_sha256") if steps else None,
        "heldout_reward_start": held[0]["heldout_reward"] if held else None,
        "heldout_reward_last": held[-1]["heldout_reward"] if held else None,
        "heldout_exact_start": held[0].get("heldout_exact") if held else None,
        "heldout_exact_last": held[-1].get("heldout_exact") if held else None,
        "weight_version_start": (steps[0]["weight_version"] - 1) if steps else None,
        "restarts_from_scratch": sum(r["restarts_from_scratch"] for r in steps),
        "env_checkpoints": sum(r["env_checkpoints"] for r in steps),
        "trajectories_trained": sum(r["trajectories_trained"] for r in steps),
        "first_step": steps[0]["step"] if steps else None,
        "last_step": steps[-1]["step"] if steps else None,
        "timeline": timeline(ctx, events, rollout_ids),
        "kills": ctx.kills,
        "errors": ctx.errors,
    }
