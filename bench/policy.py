"""``belayer bench policy``: the checkpoint policies under injected sandbox failures (the paper's
Figure 12, scaled to this machine).

On a real node (NATS, Docker + CRIU, the warm-started tiny SWE model so the agent acts), SWE
rollouts run with sandbox failures injected at p = 0, 0.01 and 0.05 per environment step
(``sandbox-kill@p=P``), ``repeats`` times each, for the policies ``risk-aware``, ``always`` and
``never``. ``never`` takes no checkpoint, so each failure restarts its trajectory from the base
image: it *is* the restart-from-scratch baseline. Each configuration reports the total rollout
time and the critical-path checkpoint time (actions waiting for a checkpoint), mean and spread.
Repeat r uses the same seed in every configuration (paired runs).

Visible checkpoint time is summed over a rollout's trajectories, so it is compared with their
summed wall time (each trajectory's own critical path); the rollout time is the wall time from
acceptance to the last trajectory's end.

Targets: risk-aware's visible checkpoint time ≤ 2 % of its trajectory time (at every p); its
rollout-time increase from p = 0 to p = 0.05 ≤ ⅓ of restart-from-scratch's; no trajectory
restarted from scratch while a ready checkpoint existed.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.report import (
    Row,
    Target,
    machine_info,
    print_table,
    progress,
    target_text,
    targets_json,
    timestamp,
    verdicts,
    write_json,
)

NAME = "policy"
POLICIES = ("risk-aware", "always", "never")
PROBABILITIES = (0.0, 0.01, 0.05)
TARGETS: dict[str, Target] = {
    "risk_aware_visible_fraction": ("<=", 0.02),
    "increase_ratio_vs_scratch": ("<=", 1 / 3),
    "restarts_with_checkpoint": ("<=", 0.0),
}


def belayer(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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

    rid = f"bench-{tag}-{policy.replace(':', '')}-p{int(p * 1000)}-s{seed}"
    req = RolloutRequest(
        workload="swe-bundled",  # the tasks the swe-long policy was warm-started on
        rollout_id=rid,
        tasks=tasks,
        n=n,
        seed=seed,
        policy=policy,
        sampling=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS),
        inject=parse_inject(f"sandbox-kill@p={p}") if p > 0 else [],
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
                for policy in POLICIES[r % len(POLICIES) :] + POLICIES[: r % len(POLICIES)]:
                    key = f"{policy}@{p}"
                    progress(NAME, f"repeat {r + 1}/{repeats}: {policy}, p = {p}")
                    s = await one_rollout(nc, policy=policy, p=p, seed=r, tasks=tasks, n=n, tag=tag)
                    runs.setdefault(key, []).append(s)
                    progress(
                        NAME,
                        f"  rollout {s['rollout_s']:.1f} s, visible checkpoint "
                        f"{s['visible_checkpoint_s']:.2f} s, failures {s['env_failures']}, "
                        f"restores {s['env_restores']}, scratch {s['restarts_from_scratch']}",
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
    return float(max(0.0, ra["rollout_s"]["mean"] - lo["rollout_s"]["mean"]) / scratch)


def main(
    json_path: Path,
    *,
    repeats: int = 3,
    tasks: int = 4,
    n: int = 4,
    model: Path | None = None,
) -> dict[str, Any]:
    """Run every (policy, p) ``repeats`` times on one node, print the table, write JSON."""
    machine = machine_info()
    progress(NAME, f"{machine['cpu_count']} CPUs, load average {machine['loadavg']}")
    result: dict[str, Any] = {
        "bench": NAME,
        "timestamp": timestamp(),
        "machine": machine,
        "repeats": repeats,
        "tasks": tasks,
        "n": n,
        "policies": list(POLICIES),
        "probabilities": list(PROBABILITIES),
        "scratch_baseline": "never",
        "targets": targets_json(TARGETS),
    }
    runs = measure_on_node(model, repeats=repeats, tasks=tasks, n=n)
    table = summarize(runs)
    result["runs"] = runs
    result["results"] = table
    ra = [table[f"risk-aware@{p}"]["visible_fraction"]["mean"] for p in PROBABILITIES]
    ra_values = [v for v in ra if v is not None]
    inc_ra, inc_scratch = increase(table, "risk-aware"), increase(table, "never")
    ratio = None
    if inc_ra is not None and inc_scratch is not None and inc_scratch > 0:
        ratio = max(0.0, inc_ra) / inc_scratch
    values: dict[str, float | None] = {
        "risk_aware_visible_fraction": max(ra_values) if ra_values else None,
        "increase_ratio_vs_scratch": ratio,
        "restarts_with_checkpoint": float(
            sum(table[k]["restarts_with_checkpoint"] for k in table if k.startswith("risk-aware"))
        ),
    }
    result.update(
        risk_aware_increase_s=inc_ra, scratch_increase_s=inc_scratch,
        risk_aware_work_increase_s=increase(table, "risk-aware", "trajectory_s"),
        scratch_work_increase_s=increase(table, "never", "trajectory_s"),
        hidden_checkpoint_cost_s=hidden_checkpoint_cost(table, repeats),
        ratio_vs_no_checkpoints=ratio_vs_no_checkpoints(table),
        values=values, verdicts=verdicts(TARGETS, values),
    )  # fmt: skip
    print_table("bench policy: sandbox failures vs checkpoint policy", report_rows(result))
    write_json(json_path, result)
    return result


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
    """The printed table: every (policy, p), the two cost figures, the targets' values."""
    table, values = result["results"], result["values"]
    rows: list[Row] = []
    for p in PROBABILITIES:
        for policy in POLICIES:
            t = table[f"{policy}@{p}"]
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
    for key, label, unit in (
        (
            "risk_aware_visible_fraction",
            "risk-aware visible checkpoint / trajectory time (max over p)",
            "%",
        ),
        ("increase_ratio_vs_scratch", "risk-aware increase p=0→0.05 / restart-from-scratch's", "x"),
        (
            "restarts_with_checkpoint",
            "risk-aware restarts from scratch with a ready checkpoint",
            "",
        ),
    ):
        value = values[key]
        shown = (
            "n/a" if value is None else (f"{value * 100:.2f} %" if unit == "%" else f"{value:.3g}")
        )
        rows.append(Row(label, shown, target_text(TARGETS[key], unit), result["verdicts"][key]))
    return rows
