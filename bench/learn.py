"""``belayer bench learn``: does a run learn, in every seed?

``belayer run WORKLOAD --steps N --seed S`` with every other option at its default, once per
seed, each on a fresh node (a subprocess each, ``$BELAYER_HOME`` an empty directory, as
``belayer bench transparency`` runs them) — or, with ``runs``, the run directories of runs
made before (their ``report.json`` and ``metrics.jsonl``). Per seed: held-out greedy exact
accuracy (swe: the share of held-out instances solved, reward 1.0; the held-out families apart,
``family_gain``) before training (step 0) and after the last step, and the gain with its 95 %
interval (paired bootstrap over the held-out problems: each problem right or wrong at step 0
and at the last step). Target: a gain of at least ``GAIN_TARGET`` in every seed; a seed's
verdict reads its interval (``PASS`` when all of it meets the target, ``UNSURE`` when it
straddles it). The plot ``learning.png`` beside the JSON shows every seed's held-out curve;
``solved`` keeps the held-out tasks solved at every evaluation (the bench removes its run
directories when it ends, stopped or not).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.report import MISS, PASS, Row, machine_at_start, progress, publish, timestamp
from bench.stats import interval_verdict
from bench.transparency import belayer_run, warm_model
from common.stats import paired_gain
from workloads.swe_gen import parse_instance_id

NAME = "learn"
GAIN_TARGET = 0.15
"""Held-out greedy exact accuracy gained from step 0 to the last step, in every seed."""


def curve(metrics: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, held-out greedy exact) of every evaluated step, step 0 first: the run's
    ``heldout_exact`` (answer tasks), else the share of counted held-out tasks solved
    (reward 1.0: tasks scored by tests)."""
    out = {}
    for r in metrics:
        if r.get("heldout_exact") is not None:
            out[r["step"]] = r["heldout_exact"]
        elif solved := right(r):
            out[r["step"]] = round(sum(solved.values()) / len(solved), 4)
    return sorted(out.items())


def solved_by_step(metrics: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Evaluated step → the held-out task ids solved there (reward 1.0; every held-out task,
    the swe held-out families included): which problems a gain or a loss was made of, kept
    in the JSON since the bench removes its run directories."""
    out = {}
    for r in metrics:
        if r.get("heldout_rewards"):
            out[str(r["step"])] = sorted(t for t, ok in right(r, lambda _: True).items() if ok)
    return out


def training_curves(metrics: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per trained step: the sampled rollouts' exact-match share (``reward_exact``) and their
    mean model tokens per trajectory (``tokens / trajectories_trained``)."""
    steps = [r for r in metrics if r.get("step", 0) >= 1]
    return {
        "train_exact": [(r["step"], r["reward_exact"]) for r in steps
                        if r.get("reward_exact") is not None],
        "response_tokens": [(r["step"], round(r["tokens"] / r["trajectories_trained"], 2))
                            for r in steps if r.get("tokens") and r.get("trajectories_trained")],
    }  # fmt: skip


def counted(task_id: str) -> bool:
    """Whether a held-out task counts towards the gain: every one but the generated swe tasks
    of held-out *families* (fixes never trained on; ``family_gain`` reports them apart) — for
    swe the target is about held-out instances of the training families."""
    found = parse_instance_id(task_id)
    return found is None or found[1] != "heldout-family"


def right(record: dict[str, Any], keep: Callable[[str], bool] = counted) -> dict[str, bool]:
    """Held-out task id → answered exactly (reward 1.0) at that step, for the tasks ``keep``
    keeps."""
    rewards = record.get("heldout_rewards", {})
    return {t: float(r) >= 1.0 for t, r in rewards.items() if keep(t)}


def gain(metrics: list[dict[str, Any]], keep: Callable[[str], bool] = counted) -> dict[str, Any]:
    """Step 0 and the last evaluated step's exact accuracy, their difference and its paired
    bootstrap interval over the held-out problems ``keep`` keeps (``None`` fields when a step
    is missing or no problem is kept)."""
    evaluated = [r for r in metrics if r.get("heldout_rewards")]
    first, last = (right(evaluated[0], keep), right(evaluated[-1], keep)) if evaluated else ({}, {})
    if len(evaluated) < 2 or evaluated[0].get("step") != 0 or not first:
        return {"start": None, "last": None, "gain": None, "interval": None, "last_step": None}
    before = {t: float(ok) for t, ok in first.items()}
    after = {t: float(last[t]) for t in first if t in last}
    interval = paired_gain(before, after)
    return {
        "start": sum(first.values()) / len(first),
        "last": sum(last.values()) / len(last),
        "gain": interval.value if interval else _gain_of_one(before, after),
        "interval": interval,
        "problems": len(after),
        "last_step": evaluated[-1]["step"],
    }


def _gain_of_one(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The gain of a single problem (no interval from one pair), None of none."""
    return next((after[t] - before[t] for t in after), None)


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run directory's report and metrics (``{}`` / ``[]`` where missing)."""
    try:
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        report = {}
    metrics = []
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                metrics.append(json.loads(line))
            except ValueError:
                continue
    except OSError:
        pass
    return report, metrics


def seed_result(seed: int, run_dir: Path, report: dict[str, Any]) -> dict[str, Any]:
    _, metrics = read_run(run_dir)
    g = gain(metrics)
    family = gain(metrics, lambda t: not counted(t))
    errors = list(report.get("errors") or [])
    if g["gain"] is None:
        errors.append(f"{run_dir}: no held-out evaluation at step 0 and after it")
    interval = g["interval"]
    return {
        "seed": seed,
        **g,
        "interval": interval.as_json() if interval is not None else None,
        "verdict": interval_verdict(interval, ">=", GAIN_TARGET),
        "curve": curve(metrics),
        "solved": solved_by_step(metrics),
        "family_gain": {k: family[k] for k in ("start", "last", "gain", "problems")}
        if family["gain"] is not None
        else None,
        **training_curves(metrics),
        "wall_seconds": report.get("wall_seconds"),
        "trajectories_lost": report.get("trajectories_lost"),
        "errors": errors,
    }


def plot(path: Path, workload: str, seeds: list[dict[str, Any]]) -> str | None:
    """Every seed's held-out curve in one PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for s in seeds:
        if s["curve"]:
            ax.plot(*zip(*s["curve"], strict=True), "o-", ms=3, label=f"seed {s['seed']}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step (0: before training)")
    ax.set_ylabel(
        "held-out instances solved (greedy)" if workload == "swe" else "held-out greedy exact"
    )
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if any(s["curve"] for s in seeds):
        ax.legend(loc="lower right", fontsize=8)
    what = "held-out instances solved" if workload == "swe" else "held-out accuracy"
    ax.set_title(f"belayer run {workload}: {what} per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(
    json_path: Path,
    *,
    workload: str = "math",
    steps: int = 20,
    seeds: Sequence[int] = (0, 1, 2),
    runs: Sequence[Path] = (),
    run_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Run (or read, ``runs``: one directory per seed, in ``seeds`` order) and judge;
    ``run_args``: more ``belayer run`` options for every run."""
    machine = machine_at_start(NAME)
    if runs and len(runs) != len(seeds):
        raise ValueError(f"{len(runs)} run directories for {len(seeds)} seeds")
    results, tmp = [], None
    if runs:
        for seed, run_dir in zip(seeds, runs, strict=True):
            report, _ = read_run(Path(run_dir))
            results.append(seed_result(seed, Path(run_dir), report))
    else:
        tmp = Path(tempfile.mkdtemp(prefix="belayer-bench-learn-"))
        try:  # removed however the runs end: a stopped bench leaves no run directories
            model = warm_model(workload, tmp / "model")
            for seed in seeds:
                label = f"seed{seed}"
                report = belayer_run(
                    tmp, label, workload, model, steps, "", list(run_args), seed, NAME
                )
                results.append(seed_result(seed, tmp / label, report))
                progress(NAME, f"seed {seed}: {results[-1]['start']} → {results[-1]['last']}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    problems = [e for r in results for e in r["errors"]]
    verdict = MISS if problems else _overall([r["verdict"] for r in results])
    picture = plot(Path(json_path).with_suffix(".png"), workload, results)
    result: dict[str, Any] = {
        "bench": NAME, "timestamp": timestamp(), "machine": machine, "workload": workload,
        "steps": steps, "run_args": list(run_args), "seeds": results, "gain_target": GAIN_TARGET, "verdict": verdict,
        "problems": problems, "plot": picture,
        "verdict_basis": "per seed: the 95 % paired-bootstrap interval of the held-out gain "
        f"against +{GAIN_TARGET}; overall PASS only when every seed passes",
    }  # fmt: skip
    title = f"bench {NAME}: belayer run {workload} --steps {steps} {' '.join(run_args)}".rstrip()
    title += f", {len(results)} seeds"
    publish(NAME, title, rows(result), json_path, result)
    return result


def _overall(verdicts: list[str]) -> str:
    if verdicts and all(v == PASS for v in verdicts):
        return PASS
    return MISS if any(v == MISS for v in verdicts) else "UNSURE"


def rows(result: dict[str, Any]) -> list[Row]:
    out = []
    what = "held-out instances solved" if result["workload"] == "swe" else "held-out exact"
    for s in result["seeds"]:
        if s["gain"] is None:
            out.append(Row(f"seed {s['seed']}: held-out gain", "n/a", "", MISS))
            continue
        low, high = (s["interval"] or {}).get("ci95", (float("nan"), float("nan")))
        value = f"{s['start']:.3f} → {s['last']:.3f} ({s['gain']:+.3f} [{low:+.3f} … {high:+.3f}])"
        out.append(
            Row(f"seed {s['seed']}: {what}, step 0 → {s['last_step']}", value,
                f"≥ +{GAIN_TARGET}", s["verdict"])
        )  # fmt: skip
    out.append(Row("verdict", result["verdict"], "", result["verdict"]))
    return out
