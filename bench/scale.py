"""``belayer bench scale``: a simulation at the paper's scale (its Fig. 7 and Fig. 12, as
numbers), driven by the production cores. **A simulation, not a measurement.**

One GRPO step — 64 prompts × 8 samples, 32 engines of 16 sequences, 512 sandboxes, SWE-length
trajectories (up to 20 turns, responses up to 4k tokens, a 32k context) — runs on a simulated
clock (``bench.scale_sim``): generation time from a decode rate per sequence and a prefill rate,
environment step times drawn per turn, failures as Poisson processes per engine and per sandbox.
Every decision is made by the code the services run: ``RouterCore`` (placement, token-level
resume after a handover, the baseline's regeneration from the prompt), ``TrajectoryCore`` over
the ``Episode`` state machine (turns, context, restore to the latest ready prefix, restart from
scratch), ``CheckpointPolicy`` (Algorithm 1, learning λ and q online), ``Batcher`` and
``group_advantages`` (the update's batch). Costs are this machine's measured ones, scaled by
the stated factors (``ScaleConfig``); the baseline's engine recovery is the paper's own
figures for Qwen3-32B (30 s heartbeat detection, 38.5 s engine reconstruction).

Belayer: shadow handover (measured ~68 ms × ``handover_factor``) and token-level resume; the
risk-aware policy's checkpoints (measured 331 ms × ``checkpoint_factor``), restores (428 ms ×
``restore_factor``). Baseline: heartbeat detection + cold restart + regeneration from the
prompt; every sandbox failure restarts its trajectory from scratch (policy ``never``).

Reported, with a seeded bootstrap 95 % interval over the seeds: the failure-free step time of
both and Belayer's overhead (Fig. 7); the rollout-time increase over the failure-free rollout at
several sandbox failure probabilities, Belayer's and restart-from-scratch's, and their ratio
(Fig. 12); the step time with engine and sandbox failures together; counts of failures,
handovers, checkpoints, restores, restarts, policy decisions.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypedDict

from bench.report import Row, machine_info, progress, publish, timestamp
from bench.scale_sim import ScaleConfig, Sim
from bench.stats import bootstrap_many, ci_text, intervals_json

NAME = "scale"
SWEEP = (0.01, 0.02, 0.05)
"""Sandbox failure probabilities per environment step (the paper injects 0.01 in Fig. 12)."""


class Faults(TypedDict, total=False):
    """The ``ScaleConfig`` fields a scenario sets (typed, so ``dataclasses.replace`` checks them)."""

    sandbox_p: float
    engine_failures_per_hour: float


FAILURES: Faults = {"sandbox_p": 0.01, "engine_failures_per_hour": 0.25}
"""The 'with failures' step: the paper's sandbox probability and engine failures at 0.25 per
engine-hour (an assumed stress rate: about one engine failure per step of 32 engines)."""
SYSTEMS = ("belayer", "baseline")
COUNTS = (
    "sandbox_failures", "restores", "restarts_from_scratch", "checkpoints", "policy_decisions",
    "engine_failures", "resumed_requests", "regenerated_tokens", "requests",
)  # fmt: skip


COUNT_LABELS = {
    "sandbox_failures": "sandbox failures", "restores": "restores",
    "restarts_from_scratch": "scratch", "checkpoints": "checkpoints",
    "policy_decisions": "decisions", "engine_failures": "engine failures",
    "resumed_requests": "resumed", "regenerated_tokens": "regenerated tokens",
}  # fmt: skip


def scenarios() -> dict[str, Faults]:
    """Scenario name → the ``ScaleConfig`` fields it sets."""
    out: dict[str, Faults] = {"free": {}}
    for p in SWEEP:
        out[f"sandbox@{p}"] = {"sandbox_p": p}
    out["failures"] = FAILURES.copy()
    return out


def simulate(cfg: ScaleConfig, *, belayer: bool, seed: int) -> dict[str, Any]:
    """One step (rollout, then the update's batch and its time) of one system."""
    sim = Sim(cfg, belayer=belayer, seed=seed)
    rollout_s = sim.run()
    train_s, trained = train_step(sim)
    recs = [t.core.recovery for t in sim.trajs.values()]
    timings = [t.core.timings for t in sim.trajs.values()]
    metrics = sim.router.metrics()
    return {
        "rollout_s": rollout_s,
        "train_s": train_s,
        "step_s": rollout_s + train_s,
        "trained_samples": trained,
        "visible_checkpoint_s": sum(t.visible_checkpoint_s for t in timings),
        "trajectory_s": sum(t.done_at or 0.0 for t in sim.trajs.values()),
        "sandbox_failures": sum(r.sandbox_failures for r in recs),
        "restores": sum(r.restores for r in recs),
        "restarts_from_scratch": sum(r.restarts_from_scratch for r in recs),
        "restarts_with_checkpoint": sum(r.restarts_from_scratch_with_checkpoint for r in recs),
        "checkpoints": sum(r.checkpoints for r in recs),
        "policy_decisions": sum(len(r.decisions) for r in recs),
        "engine_failures": sim.counts["engine_failures"],
        "resumed_requests": metrics["resumes"],
        "regenerated_tokens": metrics["regenerated_tokens"] * cfg.token_block,
        "requests": metrics["requests"],
    }


def train_step(sim: Sim) -> tuple[float, int]:
    """The update after the rollout: the trainer's ``Batcher`` takes every trajectory as a
    ``Sample`` and forms the step's batch; ``group_advantages`` computes its advantages. Its
    time: the batch's tokens at ``train_tps`` plus the weight sync."""
    from services.trainer.core import Batcher, Sample, Verdict, batch_rewards, group_advantages

    cfg = sim.cfg
    batcher = Batcher(group_size=cfg.samples, groups_per_step=cfg.prompts)
    for traj in sim.trajs.values():
        c = traj.core
        sample = Sample(
            trajectory_id=c.trajectory_id, group_id=f"step/g{traj.index // cfg.samples}",
            sample_index=traj.index % cfg.samples, prompt_ids=tuple(c.prompt_ids),
            response_ids=tuple(c.response_ids), loss_mask=tuple(c.loss_mask),
            rollout_logprobs=tuple(c.logprobs), weight_versions=tuple(c.weight_versions),
            reward=traj.reward, slot=traj.index,
        )  # fmt: skip
        if batcher.offer(sample, 0) is not Verdict.ACCEPTED:
            raise RuntimeError(f"the batcher refused {c.trajectory_id}")
    batch = batcher.next_batch(0)
    if batch is None:
        raise RuntimeError("the batcher formed no batch from a complete rollout")
    group_advantages(batch_rewards(batch), cfg.samples)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch) * cfg.token_block
    return tokens / cfg.train_tps + cfg.weight_sync_s, len(batch)


def _job(args: tuple[ScaleConfig, str, str, int]) -> tuple[str, str, int, dict[str, Any]]:
    cfg, scenario, system, seed = args
    return scenario, system, seed, simulate(cfg, belayer=system == "belayer", seed=seed)


def run_all(base: ScaleConfig, seeds: Sequence[int], jobs: int) -> dict[str, list[dict[str, Any]]]:
    """Every (scenario, system) for every seed: key ``<scenario>/<system>`` → per-seed results
    in seed order (seed i of every key is one paired repeat)."""
    work = [
        (dataclasses.replace(base, **fields), scenario, system, seed)
        for seed in seeds
        for scenario, fields in scenarios().items()
        for system in SYSTEMS
    ]
    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for scenario, system, seed, r in pool.map(_job, work):
                found[(scenario, system, seed)] = r
                progress(NAME, f"seed {seed}: {scenario}, {system}: rollout {r['rollout_s']:.0f} s")
    else:
        for item in work:
            scenario, system, seed, r = _job(item)
            found[(scenario, system, seed)] = r
            progress(NAME, f"seed {seed}: {scenario}, {system}: rollout {r['rollout_s']:.0f} s")
    return {
        f"{sc}/{sy}": [found[(sc, sy, s)] for s in seeds] for sc in scenarios() for sy in SYSTEMS
    }


def figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float | None]:
    """The reported figures from the seeds' means (what the bootstrap resamples)."""

    def mean(key: str, metric: str) -> float:
        return statistics.fmean(r[metric] for r in runs[key])

    out: dict[str, float | None] = {}
    free_b, free_0 = mean("free/belayer", "step_s"), mean("free/baseline", "step_s")
    out["step_s_belayer"], out["step_s_baseline"] = free_b, free_0
    out["step_overhead"] = (free_b - free_0) / free_0
    for p in SWEEP:
        inc = {s: mean(f"sandbox@{p}/{s}", "rollout_s") - mean(f"free/{s}", "rollout_s")
               for s in SYSTEMS}  # fmt: skip
        out[f"increase_belayer@{p}"] = inc["belayer"] / mean("free/belayer", "rollout_s")
        out[f"increase_scratch@{p}"] = inc["baseline"] / mean("free/baseline", "rollout_s")
        out[f"increase_ratio@{p}"] = inc["belayer"] / inc["baseline"] if inc["baseline"] else None
    fail_b, fail_0 = mean("failures/belayer", "step_s"), mean("failures/baseline", "step_s")
    out["failures_step_s_belayer"], out["failures_step_s_baseline"] = fail_b, fail_0
    out["failures_added_belayer"] = (fail_b - free_b) / free_b
    out["failures_added_baseline"] = (fail_0 - free_0) / free_0
    return out


def main(
    json_path: Path, *, seeds: int = 3, first_seed: int = 0, jobs: int = 2,
    config: ScaleConfig | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Simulate every scenario for ``seeds`` seeds, print the table, write JSON."""
    cfg = config or ScaleConfig()
    seed_list = list(range(first_seed, first_seed + seeds))
    progress(NAME, f"SIMULATION: {len(scenarios()) * 2 * seeds} simulated steps, {jobs} jobs")
    runs = run_all(cfg, seed_list, jobs)
    values = figures(runs)
    intervals = bootstrap_many(
        list(range(seeds)), lambda idx: figures({k: [v[i] for i in idx] for k, v in runs.items()})
    )
    result: dict[str, Any] = {
        "bench": NAME,
        "simulation": True,
        "note": "A discrete-event simulation on a simulated clock: the router, controller, "
        "policy and trainer cores are the production ones; engines, sandboxes and time are "
        "simulated; costs are this machine's measured ones scaled by the stated factors.",
        "timestamp": timestamp(),
        "machine": machine_info(),
        "seeds": seed_list,
        "config": dataclasses.asdict(cfg),
        "scaled_costs_s": {
            "checkpoint": cfg.checkpoint_s,
            "restore": cfg.restore_s,
            "handover": cfg.handover_s,
            "fresh_sandbox": cfg.measured.fresh_sandbox_s,
            "baseline_detection": cfg.heartbeat_detect_s,
            "baseline_cold_restart": cfg.cold_restart_s,
        },
        "scenarios": scenarios(),
        "values": values,
        "intervals": intervals_json(intervals),
        "counts": {k: {c: sum(r[c] for r in v) for c in COUNTS} for k, v in runs.items()},
        "runs": runs,
    }
    title = "bench scale: a SIMULATION at the paper's scale (production cores)"
    publish(NAME, title, report_rows(result), json_path, result)
    return result


_secs = "{:.1f} s".format
_ratio = "{:.3f}".format


def _pct(x: float) -> str:
    return f"{x * 100:+.2f} %"


def _row(result: dict[str, Any], label: str, key: str, show: Any) -> Row:
    v = result["values"].get(key)
    if v is None:
        return Row(label, "n/a")
    return Row(label, show(v) + ci_text(result["intervals"].get(key), show))


def report_rows(result: dict[str, Any]) -> list[Row]:
    """The table: Fig. 7 (failure-free step time, overhead), Fig. 12 (rollout-time increases),
    the step with failures, the counts."""
    rows = [
        Row(
            "SIMULATION (simulated clock; production router/controller/policy/trainer cores)",
            f"{len(result['seeds'])} seeds",
        ),
        _row(result, "Fig. 7: failure-free step time, Belayer", "step_s_belayer", _secs),
        _row(result, "Fig. 7: failure-free step time, baseline", "step_s_baseline", _secs),
        _row(result, "Fig. 7: Belayer's failure-free step-time overhead", "step_overhead", _pct),
    ]
    for p in SWEEP:
        rows += [
            _row(result, f"Fig. 12: p = {p}: rollout-time increase, Belayer",
                 f"increase_belayer@{p}", _pct),
            _row(result, f"Fig. 12: p = {p}: rollout-time increase, restart from scratch",
                 f"increase_scratch@{p}", _pct),
            _row(result, f"Fig. 12: p = {p}: Belayer's increase / restart-from-scratch's",
                 f"increase_ratio@{p}", _ratio),
        ]  # fmt: skip
    rows += [
        _row(result, "with failures: step time, Belayer", "failures_step_s_belayer", _secs),
        _row(result, "with failures: step time, baseline", "failures_step_s_baseline", _secs),
        _row(result, "with failures: step time added, Belayer", "failures_added_belayer", _pct),
        _row(result, "with failures: step time added, baseline", "failures_added_baseline", _pct),
    ]
    for key, c in result["counts"].items():
        if key.startswith(("failures/", f"sandbox@{SWEEP[0]}/", "free/belayer")):
            shown = ", ".join(f"{COUNT_LABELS[k]} {v}" for k, v in c.items() if k != "requests")
            rows.append(Row(f"counts, {key} (all seeds)", shown))
    return rows
