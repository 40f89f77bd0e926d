"""``belayer bench serve``'s result: the targets, the numbers from the runs (the bus loss over
interleaved pairs), their intervals and the table. Pure: no node, no bus, no torch."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench import engine as engine_bench
from bench.engine import PROMPT_LEN
from bench.report import Row, Target, machine_after, ratio, target_text, targets_json, timestamp
from bench.stats import (
    Interval,
    ci_text,
    intervals_json,
    judge_all,
    median_interval,
    median_ratio,
    paired_ratio,
    two_sample,
)

REPEATS = 3
"""Runs per measurement; the median is reported."""

TARGETS: dict[str, Target] = {
    **engine_bench.TARGETS,
    "bus_loss_b8": ("<=", 0.05),
    "bus_det_ratio_b8": (">=", 0.5),
    "attach_s": ("<=", 0.2),
    "up_s": ("<=", 15.0),
}
"""Metric → (comparison, bound). ``bus_loss_b8`` (fast node vs fast engine: the bus path keeps
at least 95 % of the engine's throughput) and ``bus_det_ratio_b8`` (deterministic node vs fast
node) are fractions (0.05 = 5 %)."""


# --- report ------------------------------------------------------------------------------------
def shown(value: float | None, unit: str) -> str:
    """A value with its unit as the table shows it."""
    if value is None:
        return "n/a"
    if unit == "%":
        return f"{value * 100:.1f} %"
    if unit == "tok/s":
        return f"{value:.0f} tok/s"
    if unit == "x":
        return f"{value:.1f}x"
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def build_rows(r: dict[str, Any]) -> list[Row]:
    def row(metric: str, value: float | None, unit: str, key: str | None = None) -> Row:
        """A table row; ``key`` names its target (None: informational), judged on its
        interval (shown)."""
        if key is None:
            return Row(metric, shown(value, unit))
        interval = r["intervals"].get(key)
        text = shown(value, unit)
        if value is not None:
            text += ci_text(interval, lambda x: shown(x, unit))
        return Row(metric, text, target_text(TARGETS[key], unit), r["verdicts"].get(key, ""))

    eng, bus = r["engine_tok_s"], r["bus_tok_s"]
    eng_det, bus_det = r["engine_det_tok_s"], r["bus_det_tok_s"]
    paired = r.get("engine_alone_paired_tok_s", {})
    return [
        row("engine alone, batch 1", eng["1"], "tok/s", "engine_tok_s_b1"),
        row("engine alone, batch 8", eng["8"], "tok/s", "engine_tok_s_b8"),
        row("engine alone, deterministic, batch 1", eng_det["1"], "tok/s"),
        row("engine alone, deterministic, batch 8", eng_det["8"], "tok/s"),
        row(
            "engine deterministic / fast, batch 8",
            r["engine_det_ratio"]["8"],
            "%",
            "engine_det_ratio_b8",
        ),
        row("engine alone, interleaved with the bus runs, batch 8", paired.get("8"), "tok/s"),
        row("bus path, batch 1", bus["1"], "tok/s"),
        row("bus path, batch 8", bus["8"], "tok/s"),
        row("bus loss, batch 1", r["bus_loss"]["1"], "%"),
        row("bus loss, batch 8", r["bus_loss"]["8"], "%", "bus_loss_b8"),
        row("bus path, --deterministic, batch 1", bus_det["1"], "tok/s"),
        row("bus path, --deterministic, batch 8", bus_det["8"], "tok/s"),
        row("bus --deterministic / fast, batch 1", r["bus_det_ratio"]["1"], "%"),
        row(
            "bus --deterministic / fast, batch 8", r["bus_det_ratio"]["8"], "%", "bus_det_ratio_b8"
        ),
        row("attach from shm (worker_ready)", r["attach_s"], "s", "attach_s"),
        row("attach from shm (timed here)", r["attach_inprocess_s"], "s"),
        row("cold load (safetensors + build)", r["cold_load_s"], "s"),
        row("cold load / attach", r["cold_over_attach"], "x"),
        row("belayer up → ready (outside)", r["up_s"], "s", "up_s"),
        row("belayer up → ready (reported)", r["up_reported_s"], "s"),
    ]


def summarize(
    new_tokens: int,
    engine: dict[str, Any],
    cold: dict[str, Any],
    up: dict[str, Any],
    node: dict[str, Any],
    node_det: dict[str, Any],
    machine_before: dict[str, Any],
    up_det: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result: ``node`` is the fast (``--no-deterministic``) node's measurements (bus path,
    attach), ``node_det`` the deterministic node's bus path (and its worker's attach time);
    ``up``/``up_det`` the two nodes' start times."""
    eng = {str(b): v for b, v in engine["tok_s"].items()}
    bus = {str(b): v for b, v in node["bus"]["tok_s"].items()}
    eng_det = {str(b): v for b, v in engine["det_tok_s"].items()}
    bus_det = {str(b): v for b, v in node_det["bus"]["tok_s"].items()}
    attach = node["worker_reported"].get("attach_s", node["attach"]["attach_inprocess_s"])
    result: dict[str, Any] = {
        "bench": "serve",
        "timestamp": timestamp(),
        "unix_time": time.time(),
        "new_tokens": new_tokens,
        "prompt_tokens": PROMPT_LEN,
        "repeats": REPEATS,
        "model": engine_bench.TINY_MODEL,
        "engine_tok_s": eng,
        "bus_tok_s": bus,
        "bus_over_engine": {b: ratio(bus[b], eng[b]) for b in eng},
        "bus_loss": {b: bus_loss(node["bus"]["runs"][int(b)], eng[b]) for b in eng},
        "bus_loss_unpaired": {b: 1.0 - (ratio(bus[b], eng[b]) or 0.0) for b in eng},
        "engine_alone_paired_tok_s": paired_alone(node["bus"]["runs"]),
        "engine_det_tok_s": eng_det,
        "engine_det_ratio": {b: ratio(eng_det[b], eng[b]) for b in eng},
        "bus_det_tok_s": bus_det,
        "bus_det_loss": {b: bus_loss(node_det["bus"]["runs"][int(b)], eng_det[b]) for b in eng},
        "engine_det_alone_paired_tok_s": paired_alone(node_det["bus"]["runs"]),
        "bus_det_ratio": {b: ratio(bus_det[b], bus[b]) for b in eng},
        "attach_s": attach,
        "attach_inprocess_s": node["attach"]["attach_inprocess_s"],
        "worker_reported": node["worker_reported"],
        "load_safetensors_s": cold["load_safetensors_s"],
        "cold_load_s": cold["cold_load_s"],
        "cold_over_attach": ratio(cold["cold_load_s"], attach),
        "up_s": up["up_s"],
        "up_reported_s": up["up_reported_s"],
        "targets": targets_json(TARGETS),
        "runs": {
            "engine_tok_s": {str(b): v for b, v in engine["runs"].items()},
            "engine_det_tok_s": {str(b): v for b, v in engine["det_runs"].items()},
            "bus": {str(b): v for b, v in node["bus"]["runs"].items()},
            "bus_det": {str(b): v for b, v in node_det["bus"]["runs"].items()},
            "attach_inprocess_s": node["attach"]["runs"],
            "cold_load_s": cold["runs"],
        },
        "machine": machine_after(machine_before),
    }
    reports = [n["worker_reported"]["attach_s"] for n in (node, node_det)
               if n.get("worker_reported", {}).get("attach_s") is not None]  # fmt: skip
    ups = [u["up_s"] for u in (up, up_det) if u is not None]
    result["runs"]["attach_reported_s"] = reports
    result["runs"]["up_s"] = ups
    values = {
        "engine_tok_s_b1": eng["1"],
        "engine_tok_s_b8": eng["8"],
        "bus_loss_b8": result["bus_loss"]["8"],
        "engine_det_ratio_b8": result["engine_det_ratio"]["8"],
        "bus_det_ratio_b8": result["bus_det_ratio"]["8"],
        "attach_s": attach,
        "up_s": up["up_s"],
    }
    intervals = serve_intervals(result["runs"])
    result["intervals"] = intervals_json(intervals)
    result["verdicts"] = judge_all(TARGETS, values, intervals)
    return result


def _alone(runs: list[dict[str, Any]]) -> list[float] | None:
    """The in-process engine's tokens/s run beside each bus run, if every run has one."""
    alone = [r.get("engine_alone_tok_s") for r in runs]
    return [float(a) for a in alone if a is not None] if runs and None not in alone else None


def paired_alone(runs: dict[int, list[dict[str, Any]]]) -> dict[str, float | None]:
    """Median tokens/s of the in-process engine runs interleaved with the bus runs, per batch."""
    out: dict[str, float | None] = {}
    for b, v in runs.items():
        alone = _alone(v)
        out[str(b)] = statistics.median(alone) if alone else None
    return out


def bus_loss(runs: list[dict[str, Any]], engine_tok_s: float) -> float:
    """1 − bus / engine: over the runs' interleaved in-process engine runs where they have
    them (median over median of the pairs), else against ``engine_tok_s`` (measured before
    the node started)."""
    bus = statistics.median(r["tok_s"] for r in runs)
    alone = _alone(runs)
    return 1.0 - (ratio(bus, statistics.median(alone) if alone else engine_tok_s) or 0.0)


def serve_intervals(runs: dict[str, Any]) -> dict[str, Interval | None]:
    """Each target's 95 % bootstrap interval: the engine's over its runs (``bench.engine``),
    the bus loss over its interleaved pairs (else, for runs without them, over two independent
    samples), the deterministic node's ratio over two independent samples (different nodes),
    the attach and up times over the two nodes."""
    tok = {b: [r["tok_s"] for r in v] for b, v in runs["bus"].items()}
    tok_det = {b: [r["tok_s"] for r in v] for b, v in runs["bus_det"].items()}
    out = engine_bench.engine_intervals(runs["engine_tok_s"], runs["engine_det_tok_s"])
    alone = _alone(runs["bus"]["8"])
    if alone:  # interleaved pairs
        kept = paired_ratio(tok["8"], alone)
        out["bus_loss_b8"] = kept and Interval(1 - kept.value, 1 - kept.high, 1 - kept.low, kept.n)
    else:
        out["bus_loss_b8"] = two_sample(
            tok["8"], runs["engine_tok_s"]["8"],
            lambda a, b: 1.0 - statistics.median(a) / statistics.median(b),
        )  # fmt: skip
    out["bus_det_ratio_b8"] = median_ratio(tok_det["8"], tok["8"])
    out["attach_s"] = median_interval(runs.get("attach_reported_s", []))
    out["up_s"] = median_interval(runs.get("up_s", []))
    return out
