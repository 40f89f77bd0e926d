"""``belayer bench policy``: the checkpoint policies under injected sandbox failures (the paper's
Figure 12, scaled to this machine).

On a real node (NATS, Docker + CRIU, the warm-started tiny SWE model so the agent acts), SWE
rollouts run with sandbox failures injected at p = 0, 0.01 and 0.05 per environment step
(``sandbox-kill@p=P``), ``repeats`` times each, for the policies ``risk-aware``,
``risk-aware-oracle``, ``always`` and ``never``. ``risk-aware`` is not told p: it estimates the
failure rate from the failures it observes (a prior updated online, per environment image;
each rollout reports its estimate, ``failure_p_estimate``); ``risk-aware-oracle`` is the same
policy told the injected p (``RolloutRequest.failure_probability``). Both are reported; the
verdicts judge the estimating one. ``never`` takes no checkpoint, so each failure restarts its
trajectory from the base image: it *is* the restart-from-scratch baseline. Each configuration reports the total rollout
time and the critical-path checkpoint time (actions waiting for a checkpoint), mean and spread.
Repeat r uses the same seed in every configuration (paired runs).

Visible checkpoint time is summed over a rollout's trajectories, so it is compared with their
summed wall time (each trajectory's own critical path); the rollout time is the wall time from
acceptance to the last trajectory's end.

Targets: risk-aware's visible checkpoint time ≤ 2 % of its trajectory time (at every p); its
rollout-time increase from p = 0 to p = 0.05 ≤ ⅓ of restart-from-scratch's (a negative
increase is shown as measured, never clamped to 0); no trajectory restarted from scratch while
a ready checkpoint existed. The first two are judged on their 95 % bootstrap interval over the
repeats (a repeat's runs, one per configuration with the same seed, resampled together); the
third is an invariant: one such restart is a MISS.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from bench import report
from bench.node import belayer
from bench.report import Row, Target, progress, target_text
from bench.stats import Interval, bootstrap_many, ci_text, intervals_json, judge_all

NAME = "policy"
POLICIES = ("risk-aware", "always", "never")
"""The policies a rollout request names."""
ORACLE = "risk-aware-oracle"
"""Risk-aware told the injected probability (``failure_probability``) instead of estimating it."""
VARIANTS = ("risk-aware", ORACLE, "always", "never")
"""What runs at every p: the policies and the oracle."""
INVARIANTS = ("restarts_with_checkpoint",)
"""Targets that count violations over every trial (judged on the count, interval stated)."""
PROBABILITIES = (0.0, 0.01, 0.05)
TARGETS: dict[str, Target] = {
    "risk_aware_visible_fraction": ("<=", 0.02),
    "increase_ratio_vs_scratch": ("<=", 1 / 3),
    "restarts_with_checkpoint": ("<=", 0.0),
}


WARM_START = "swe-long"
"""The policy: the tiny model warm-started on long SWE episodes (a thought before each of 8–10
actions), so responses outlast a checkpoint and trajectories have many steps, as in the
paper's SWE runs. (The plain ``swe`` policy acts in 1–3 short steps: a checkpoint costs more
than it could save, and risk-aware rightly never takes one.)"""
MAX_TOKENS = 256
"""Tokens per response (a thought and a command take about 40)."""
MAX_TURNS = 20
"""Responses per trajectory (the paper's maximum agent rounds for SWE)."""


def warm_model(directory: Path) -> Path:
    """The warm-started tiny model of ``WARM_START`` (the model layer caches it)."""
    proc = belayer(
        "model", "init", "--tiny", "--warm-start", WARM_START, str(directory), timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"warm start failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return directory


def mean_sd(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "sd": None, "min": None, "max": None}
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


async def one_rollout(
    nc: Any, *, policy: str, p: float, seed: int, tasks: int, n: int, tag: str
) -> dict[str, Any]:
    from schemas.rollout import RolloutRequest
    from schemas.serving import SamplingParams
    from services.controller.client import parse_inject, submit, wait
    from services.controller.fault_specs import injected_probability

    rid = f"bench-{tag}-{policy.replace(':', '')}-p{int(p * 1000)}-s{seed}"
    inject = parse_inject(f"sandbox-kill@p={p}") if p > 0 else []
    req = RolloutRequest(
        workload="swe-bundled",  # the tasks the swe-long policy was warm-started on
        rollout_id=rid,
        tasks=tasks,
        n=n,
        seed=seed,
        policy="risk-aware" if policy == ORACLE else policy,
        failure_probability=(injected_probability(inject) or 0.0) if policy == ORACLE else None,
        sampling=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS),
        inject=inject,
        max_turns=MAX_TURNS,
    )
    await submit(nc, req)
    result = await wait(nc, rid, timeout=1800)
    return msgspec.structs.asdict(result.summary)


async def measure(run_dir: Path, *, repeats: int, tasks: int, n: int) -> dict[str, Any]:
    from common.bus import connect
    from common.config import RunPaths
    from common.node import resolve_bus

    url, bus = resolve_bus(None, role="client", paths=RunPaths(run_dir))
    nc = await connect(url, name="bench-policy", bus=bus)
    tag = f"{int(time.time()) % 100000}"
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        # warm-up at full size: imports, the first sandboxes, the engine's batch shapes
        await one_rollout(nc, policy="never", p=0.0, seed=999, tasks=tasks, n=n, tag=tag + "w")
        for r in range(repeats):
            for p in PROBABILITIES:
                # the policies' order rotates with the repeat, so a drift of the machine's
                # load does not always hit the same policy first
                for policy in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
                    key = f"{policy}@{p}"
                    progress(NAME, f"repeat {r + 1}/{repeats}: {policy}, p = {p}")
                    s = await one_rollout(nc, policy=policy, p=p, seed=r, tasks=tasks, n=n, tag=tag)
                    runs.setdefault(key, []).append(s)
                    progress(
                        NAME,
                        f"  rollout {s['rollout_s']:.1f} s, visible checkpoint "
                        f"{s['visible_checkpoint_s']:.2f} s, failures {s['env_failures']}, "
                        f"restores {s['env_restores']}, scratch {s['restarts_from_scratch']}, "
                        f"estimated p {s.get('failure_p_estimate')}",
                    )
    finally:
        await nc.drain()
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for key, rs in runs.items():
        table[key] = {
            "rollout_s": mean_sd([r["rollout_s"] for r in rs]),
            "visible_checkpoint_s": mean_sd([r["visible_checkpoint_s"] for r in rs]),
            "trajectory_s": mean_sd([r["trajectory_s"] for r in rs]),
            "llm_s": mean_sd([r["llm_s"] for r in rs]),
            "visible_fraction": mean_sd(
                [r["visible_checkpoint_s"] / r["trajectory_s"] for r in rs if r["trajectory_s"] > 0]
            ),
            "checkpoints": sum(r["checkpoints"] for r in rs),
            "env_failures": sum(r["env_failures"] for r in rs),
            "env_restores": sum(r["env_restores"] for r in rs),
            "restarts_from_scratch": sum(r["restarts_from_scratch"] for r in rs),
            "restarts_with_checkpoint": sum(r["restarts_from_scratch_with_checkpoint"] for r in rs),
            "completed": sum(r["trajectories_completed"] for r in rs),
            "trajectories": sum(r["trajectories"] for r in rs),
            "failure_p_estimate": mean_sd(
                [r["failure_p_estimate"] for r in rs if r.get("failure_p_estimate") is not None]
            ),
        }
    return table


def hidden_checkpoint_cost(table: dict[str, Any], repeats: int) -> float | None:
    """Trajectory seconds one checkpoint costs beyond its visible wait, from ``always`` vs
    ``never`` at p = 0 (no failure: the difference is the checkpoints'). Near 0 where the
    environment has cores of its own; on a node whose cores the engine, the sandboxes and
    CRIU share, a checkpoint hidden in the bubble still takes CPU from the rollout."""
    a, n = table.get("always@0.0"), table.get("never@0.0")
    if not a or not n or not a["checkpoints"] or a["trajectory_s"]["mean"] is None:
        return None
    extra = (
        a["trajectory_s"]["mean"] - n["trajectory_s"]["mean"] - a["visible_checkpoint_s"]["mean"]
    )
    return float(extra / (a["checkpoints"] / repeats))


def increase(table: dict[str, Any], policy: str, metric: str = "rollout_s") -> float | None:
    """Mean ``metric`` at p = 0.05 minus at p = 0."""
    hi, lo = table.get(f"{policy}@0.05"), table.get(f"{policy}@0.0")
    if not hi or not lo or hi[metric]["mean"] is None or lo[metric]["mean"] is None:
        return None
    return float(hi[metric]["mean"] - lo[metric]["mean"])


def ratio_vs_no_checkpoints(table: dict[str, Any]) -> float | None:
    """Risk-aware at p = 0.05 against ``never`` at p = 0 (no checkpoint, no failure), over
    restart-from-scratch's own increase: the target's ratio with risk-aware's checkpoints at
    p = 0 counted as part of its cost instead of its baseline."""
    ra, lo, hi = (table.get(k) for k in ("risk-aware@0.05", "never@0.0", "never@0.05"))
    if not ra or not lo or not hi:
        return None
    scratch = hi["rollout_s"]["mean"] - lo["rollout_s"]["mean"]
    if scratch <= 0:
        return None
    # As measured: below never's p = 0 time it is negative (noise), not clamped to 0.
    return float((ra["rollout_s"]["mean"] - lo["rollout_s"]["mean"]) / scratch)


def judged_values(table: dict[str, Any], policy: str = "risk-aware") -> dict[str, float | None]:
    """The targets' values for ``policy`` (``risk-aware`` or the oracle). The increase ratio
    is as measured: a negative increase (p = 0.05 faster than p = 0, noise) stays negative."""
    fractions = [
        table[k]["visible_fraction"]["mean"]
        for k in (f"{policy}@{p}" for p in PROBABILITIES)
        if k in table and table[k]["visible_fraction"]["mean"] is not None
    ]
    inc, scratch = increase(table, policy), increase(table, "never")
    return {
        "risk_aware_visible_fraction": max(fractions) if fractions else None,
        "increase_ratio_vs_scratch": (
            inc / scratch if inc is not None and scratch is not None and scratch > 0 else None
        ),
        "restarts_with_checkpoint": float(
            sum(table[k]["restarts_with_checkpoint"] for k in table if k.startswith(f"{policy}@"))
        ),
    }


def repeat_intervals(
    runs: dict[str, list[dict[str, Any]]], policy: str = "risk-aware"
) -> dict[str, Interval | None]:
    """Each target's value with its 95 % bootstrap interval over the repeats: repeat r's runs
    (every configuration, the same seed) are resampled together."""
    repeats = min((len(v) for v in runs.values()), default=0)
    return bootstrap_many(
        list(range(repeats)),
        lambda idx: judged_values(_means({k: [v[i] for i in idx] for k, v in runs.items()}),
                                  policy),
    )  # fmt: skip


def _means(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What ``judged_values`` reads of ``summarize``'s table, alone (cheap enough to be
    computed for every bootstrap resample)."""

    def mean(xs: list[float]) -> dict[str, float | None]:
        return {"mean": sum(xs) / len(xs) if xs else None}

    return {
        key: {
            "rollout_s": mean([r["rollout_s"] for r in rs]),
            "visible_fraction": mean(
                [r["visible_checkpoint_s"] / r["trajectory_s"] for r in rs if r["trajectory_s"] > 0]
            ),
            "restarts_with_checkpoint": sum(r["restarts_from_scratch_with_checkpoint"] for r in rs),
        }
        for key, rs in runs.items()
    }


def failure_p(table: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per injected p: the oracle (p itself) and what risk-aware estimated (mean over its
    rollouts of each rollout's final estimate)."""
    return {
        str(p): {
            "oracle": p,
            "estimated": table.get(f"risk-aware@{p}", {}).get("failure_p_estimate"),
        }
        for p in PROBABILITIES
    }


def main(
    json_path: Path,
    *,
    repeats: int = 3,
    tasks: int = 4,
    n: int = 4,
    model: Path | None = None,
) -> dict[str, Any]:
    """Run every (policy, p) ``repeats`` times on one node, print the table, write JSON."""
    machine = report.machine_at_start(NAME)
    result: dict[str, Any] = {
        "bench": NAME,
        "timestamp": report.timestamp(),
        "machine": machine,
        "repeats": repeats,
        "tasks": tasks,
        "n": n,
        "policies": list(VARIANTS),
        "oracle": ORACLE,
        "probabilities": list(PROBABILITIES),
        "scratch_baseline": "never",
        "targets": report.targets_json(TARGETS),
    }
    runs = measure_on_node(model, repeats=repeats, tasks=tasks, n=n)
    result["runs"] = runs
    result.update(judge_runs(runs, repeats))
    title = "bench policy: sandbox failures vs checkpoint policy"
    report.publish(NAME, title, report_rows(result), json_path, result)
    return result


def judge_runs(runs: dict[str, list[dict[str, Any]]], repeats: int) -> dict[str, Any]:
    """The result's judged part: the table, the values with their intervals and verdicts
    (risk-aware, estimating), the oracle's beside them, the cost figures."""
    table = summarize(runs)
    values = judged_values(table)
    intervals = repeat_intervals(runs)
    oracle = judged_values(table, ORACLE)
    oracle_intervals = repeat_intervals(runs, ORACLE)
    return dict(
        results=table,
        risk_aware_increase_s=increase(table, "risk-aware"),
        scratch_increase_s=increase(table, "never"),
        oracle_increase_s=increase(table, ORACLE),
        risk_aware_work_increase_s=increase(table, "risk-aware", "trajectory_s"),
        scratch_work_increase_s=increase(table, "never", "trajectory_s"),
        hidden_checkpoint_cost_s=hidden_checkpoint_cost(table, repeats),
        ratio_vs_no_checkpoints=ratio_vs_no_checkpoints(table),
        failure_p=failure_p(table),
        values=values,
        intervals=intervals_json(intervals),
        verdicts=judge_all(TARGETS, values, intervals, INVARIANTS),
        oracle_values=oracle,
        oracle_intervals=intervals_json(oracle_intervals),
        oracle_verdicts=judge_all(TARGETS, oracle, oracle_intervals, INVARIANTS),
    )


def measure_on_node(model: Path | None, *, repeats: int, tasks: int, n: int) -> dict[str, Any]:
    """Start a node with the environment service and the (warm-started) model, run every
    (policy, p) on it, stop it."""
    with tempfile.TemporaryDirectory(prefix="belayer-bench-policy-") as tmp:
        model_dir = model or warm_model(Path(tmp) / "model")
        run_dir = Path(tmp) / "run"
        progress(NAME, "starting a node with the environment service and the warm-started model")
        up = belayer(
            "up", "--detach", "--run-dir", str(run_dir), "--engines", "1", "--environment",
            "--model", str(model_dir), timeout=300,
        )  # fmt: skip
        if up.returncode != 0:
            raise RuntimeError(f"belayer up failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
        try:
            return asyncio.run(measure(run_dir, repeats=repeats, tasks=tasks, n=n))
        finally:
            belayer("down", "--run-dir", str(run_dir), timeout=120)


def report_rows(result: dict[str, Any]) -> list[Row]:
    """The printed table: every (policy, p), the estimated failure probability, the two cost
    figures, the targets' values with their intervals (and the oracle's beside them)."""
    table = result["results"]
    rows: list[Row] = []
    for p in PROBABILITIES:
        for policy in VARIANTS:
            t = table.get(f"{policy}@{p}")
            if t is None:
                continue
            label = "never (= restart from scratch)" if policy == "never" else policy
            r, v, w = t["rollout_s"], t["visible_checkpoint_s"], t["trajectory_s"]
            rows.append(
                Row(
                    f"p = {p}: {label}: rollout / trajectories / visible checkpoint",
                    f"{r['mean']:.1f} ± {r['sd']:.1f} s / {w['mean']:.1f} s / {v['mean']:.2f} s "
                    f"({t['checkpoints']} checkpoints, {t['env_failures']} failures, "
                    f"{t['env_restores']} restores, {t['restarts_from_scratch']} scratch)",
                )
            )
    for p, fp in result["failure_p"].items():
        est = (fp["estimated"] or {}).get("mean")
        rows.append(
            Row(
                f"p = {p}: failure probability per step, risk-aware's estimate / injected",
                f"{'n/a' if est is None else f'{est:.4f}'} / {fp['oracle']:g}",
            )
        )
    hidden = result["hidden_checkpoint_cost_s"]
    rows.append(
        Row(
            "always vs never at p = 0: trajectory time a checkpoint costs beyond its wait",
            "n/a" if hidden is None else f"{hidden:.3f} s per checkpoint",
        )
    )
    strict = result["ratio_vs_no_checkpoints"]
    rows.append(
        Row(
            "risk-aware at p = 0.05 over never at p = 0 / restart-from-scratch's increase",
            "n/a" if strict is None else f"{strict:.3g}",
        )
    )
    increases = (result["risk_aware_increase_s"], result["scratch_increase_s"])
    rows.append(
        Row(
            "rollout-time increase p = 0 → 0.05, risk-aware / restart from scratch",
            " / ".join("n/a" if x is None else f"{x:+.1f} s" for x in increases),
        )
    )
    for key, label, unit in LABELS:
        rows.append(_target_row(result, key, label, unit))
        rows.append(
            _target_row(result, key, f"  {ORACLE} (told p; not judged)", unit, prefix="oracle_")
        )
    return rows


LABELS = (
    ("risk_aware_visible_fraction", "risk-aware visible checkpoint / trajectory time (max over p)",
     "%"),
    ("increase_ratio_vs_scratch", "risk-aware increase p=0→0.05 / restart-from-scratch's", "x"),
    ("restarts_with_checkpoint", "risk-aware restarts from scratch with a ready checkpoint", ""),
)  # fmt: skip


def _shown(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:.2f} %" if unit == "%" else f"{value:.3g}"


def _target_row(result: dict[str, Any], key: str, label: str, unit: str, prefix: str = "") -> Row:
    """A target's row: the value as measured, its interval, the verdict (the oracle's rows
    show theirs as information)."""
    value = result[f"{prefix}values"][key]
    interval = result[f"{prefix}intervals"].get(key)
    shown = _shown(value, unit)
    if value is not None:
        shown += ci_text(interval, lambda x: _shown(x, unit))
    verdict = result[f"{prefix}verdicts"].get(key, "")
    if prefix:
        return Row(label, shown + (f" ({verdict})" if verdict else ""))
    return Row(label, shown, target_text(TARGETS[key], unit), verdict)
