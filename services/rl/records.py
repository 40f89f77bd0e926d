"""What the RL loop records: one step's ``metrics.jsonl`` line (``step_record``, carried with
the results it was made of in a ``StepRecord``), the evaluation before training (step 0), and
the run's totals and timeline (the ``belayer run --json`` report)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.events import EventTail
from common.stats import paired_gain
from schemas.events import (
    FailureInjected,
    FailureRecovered,
    HandoverComplete,
    LogprobMismatch,
    ServiceRestarted,
    TrainerCheckpointed,
    TrainerResumed,
    TrainStep,
    TrajectoryRestored,
)
from schemas.rollout import RolloutResult, Trajectory
from services.rl.counters import compared_nothing, exact_share, lost_slots
from services.rl.held_out import EvalResult
from services.rl.options import StepFaults, step_tasks

if TYPE_CHECKING:
    from services.rl.loop import RunContext


@dataclass
class Phases:
    """Seconds per phase of one step."""

    rollout: float = 0.0
    reward: float = 0.0
    train: float = 0.0
    push: float = 0.0
    eval: float = 0.0


@dataclass
class Batch:
    """The step's trajectories as the trainer gets them."""

    trajectories: list[Trajectory]
    reward_mean: float
    reward_std: float
    model_tokens: int
    samples: list[dict[str, Any]]


@dataclass
class StepRecord:
    """One step of the loop (``loop.run_step``): its ``metrics.jsonl`` line and what the line
    was made of."""

    line: dict[str, Any]
    """The ``metrics.jsonl`` line (``step_record``)."""
    rollout: RolloutResult
    batch: Batch
    trained: TrainStep
    held: EvalResult | None
    """The held-out evaluation after the step (None: not evaluated, ``loop.evaluates``)."""
    times: Phases


def held_fields(held: EvalResult) -> dict[str, Any]:
    """A step's ``heldout_*`` fields."""
    return {
        "heldout_reward": round(held.mean, 4),
        "heldout_exact": _rounded(held.exact_mean),
        "heldout_rewards": held.rewards,
    }


def step0_record(ctx: RunContext, held: EvalResult) -> dict[str, Any]:
    return {
        "step": 0,
        "run_id": ctx.state.run_id,
        **held_fields(held),
        "eval_s": round(held.seconds, 3),
        "weight_version": min(held.versions) if held.versions else None,
        "ts": time.time(),
    }


def step_record(
    ctx: RunContext,
    step: int,
    faults: StepFaults,
    result: RolloutResult,
    batch: Batch,
    trained: TrainStep,
    held: EvalResult | None,
    times: Phases,
    events: EventTail,
    t_start: float,
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line (without the ``heldout_*`` fields when ``held`` is None:
    the step was not evaluated)."""
    s = result.summary
    rid = result.rollout_id
    own = [k for k in ctx.kills if k["step"] == step]
    handovers = len(events.matching(HandoverComplete, after=t_start))
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
        **(held_fields(held) if held is not None else {}),
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
        "trainer_restarts": len(events.matching(TrainerResumed, after=t_start)),
        "checkpoints": len(events.matching(TrainerCheckpointed, after=t_start)),
        "replay": trained.replay,
        "inject": [f.text for f in faults.rollout] + [k["injection"] for k in own],
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
    earlier = [r for r in steps if r["step"] < ctx.start_step]  # earlier invocations' steps
    held = [r for r in records if "heldout_reward" in r]
    rollout_ids = {r["rollout_id"] for r in steps}
    for e in events.matching(LogprobMismatch):
        ctx.errors.append(f"logprob_mismatch at step {e.step}: {e.logprob_diff_max:.3g}")
    fired = {e.injection for e in events.matching(FailureInjected) if e.rollout_id in rollout_ids}
    fired |= {k["injection"] for k in ctx.kills}
    for s in ctx.specs:
        if s.trigger == "step" and int(s.value) <= (steps[-1]["step"] if steps else 0):
            if int(s.value) >= ctx.start_step and s.text not in fired:
                ctx.errors.append(f"{s.text} did not fire")
    return {
        "steps": len(steps),
        "steps_planned": ctx.steps,
        "invocations": ctx.state.incarnations,
        "trajectories_completed": sum(r["trajectories_completed"] for r in steps),
        "trajectories_lost": sum(r["trajectories_lost"] for r in steps),
        "failures_injected": sum(r["failures_injected"] for r in steps),
        "failures_recovered": sum(r["failures_recovered"] for r in steps),
        "env_restores": sum(r["env_restores"] for r in steps),
        "handovers": sum(r["handovers"] for r in steps),
        # This invocation's from its node's events, earlier invocations' from their steps.
        "trainer_restarts": len(events.matching(TrainerResumed))
        + sum(r.get("trainer_restarts", 0) for r in earlier),
        "checkpoints": len(events.matching(TrainerCheckpointed))
        + sum(r.get("checkpoints", 0) for r in earlier),
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
        "heldout_gain": heldout_gain(held),
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


def heldout_gain(held: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The held-out reward's change from before training (step 0) to the last evaluation,
    with its 95 % paired-bootstrap interval over the held-out tasks (``{"value", "ci95",
    "n"}``); None without both evaluations or with fewer than 2 tasks in both."""
    if len(held) < 2 or held[0].get("step") != 0:
        return None
    gain = paired_gain(held[0].get("heldout_rewards") or {}, held[-1].get("heldout_rewards") or {})
    return gain.as_json() if gain is not None else None
