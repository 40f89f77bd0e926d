"""What ``belayer run`` writes under its run directory, and the tables it prints.

- ``metrics.jsonl``: one JSON object per step (step 0: the held-out evaluation before any
  update), appended as each step ends;
- ``tb/``: the same scalars as TensorBoard event files (``torch.utils.tensorboard``);
- ``samples.jsonl``: a few trajectories per step (prompt, response text, reward, recovery
  events);
- ``report.json`` / ``report.md``: the run's totals and per-step table;
- ``plots/reward.png``, ``plots/time.png``, ``plots/failures.png``: reward per step (training
  mean and held-out greedy), the time split per step, the timeline of injected failures and
  recoveries.

A writer that fails (a full disk, a missing package) logs ``metrics_write_failed`` once per
writer and is switched off; training never stops for it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.table import Table

from common.logging import get_logger
from common.machine import cpu_text

log = get_logger(component="run")

SCALARS = (
    "reward_mean",
    "reward_std",
    "heldout_reward",
    "reward_exact",
    "heldout_exact",
    "tokens",
    "loss",
    "grad_norm",
    "clip_low",
    "clip_high",
    "kl",
    "logprob_diff_max",
    "logprob_diff_mean",
    "rollout_s",
    "reward_s",
    "train_s",
    "push_s",
    "eval_s",
    "step_s",
    "failures_injected",
    "failures_recovered",
    "env_restores",
    "handovers",
    "weight_version",
)
"""The per-step numbers also written to TensorBoard (``run/<name>``)."""

CONTRACT = (
    "steps",
    "trajectories_completed",
    "trajectories_lost",
    "failures_injected",
    "failures_recovered",
    "env_restores",
    "handovers",
    "trainer_restarts",
    "checkpoints",
    "weight_version",
    "reward_first_step",
    "reward_last_step",
    "logprob_diff_max",
    "wall_seconds",
)
"""Keys ``belayer run --json`` always prints (a public contract)."""


class RunLogs:
    """The per-step writers of one run directory; each is switched off at its first
    failure (logged), never raising into the training loop."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True) -> None:
        self.dir = run_dir
        self.metrics = run_dir / "metrics.jsonl"
        self.samples = run_dir / "samples.jsonl"
        self.failed: set[str] = set()
        self._tb: Any = None
        self._want_tb = tensorboard

    def _guard(self, name: str, fn: Callable[[], object]) -> None:
        if name in self.failed:
            return
        try:
            fn()
        except Exception as exc:  # a writer's failure must never stop training
            self.failed.add(name)
            log.error("metrics_write_failed", writer=name, error=f"{type(exc).__name__}: {exc}")

    def step(self, record: dict[str, Any], samples: list[dict[str, Any]]) -> None:
        """Append one step's record and samples, and its scalars to TensorBoard."""
        self._guard("metrics.jsonl", lambda: _append(self.metrics, [record]))
        self._guard("samples.jsonl", lambda: _append(self.samples, samples))
        self._guard("tensorboard", lambda: self._scalars(record))

    def _scalars(self, record: dict[str, Any]) -> None:
        if not self._want_tb:
            return
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tb"))
        step = int(record["step"])
        for key in SCALARS:
            value = record.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                self._tb.add_scalar(f"run/{key}", float(value), step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._guard("tensorboard", self._tb.close)
            self._tb = None


def _append(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")


def rewrite_metrics(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``metrics.jsonl`` with ``records`` (a resumed run drops the steps it redoes)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in records))
    tmp.replace(path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (a torn last line is skipped)."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def last_step(records: list[dict[str, Any]]) -> int:
    """The highest step among metrics records (0 when there are none)."""
    return max((int(r.get("step", 0)) for r in records), default=0)


# --- the final report ------------------------------------------------------------------------
def step_table(records: list[dict[str, Any]], title: str) -> Table:
    """The per-step table (step 0 is the evaluation before training)."""
    t = Table(title=title)
    cols = ("step", "reward", "held-out", "exact", "tokens", "rollout s", "train s", "push s",
            "eval s", "injected", "recovered", "logprob diff")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="right")
    for r in records:
        if r.get("step", 0) == 0:
            t.add_row("0", "", _f(r.get("heldout_reward")), _f(r.get("heldout_exact")), "", "",
                      "", "", _f(r.get("eval_s"), 1), "", "", "")  # fmt: skip
            continue
        t.add_row(
            str(r["step"]), _f(r.get("reward_mean")), _f(r.get("heldout_reward")),
            _f(r.get("heldout_exact")), str(r.get("tokens", "")), _f(r.get("rollout_s"), 1), _f(r.get("train_s"), 1),
            _f(r.get("push_s"), 2), _f(r.get("eval_s"), 1), str(r.get("failures_injected", 0)),
            str(r.get("failures_recovered", 0)), _g(r.get("logprob_diff_max")),
        )  # fmt: skip
    return t


def _f(v: Any, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if isinstance(v, int | float) else ""


def _g(v: Any) -> str:
    return f"{v:.2g}" if isinstance(v, int | float) else ""


def of_planned(report: dict[str, Any]) -> str:
    """``of 20 `` when the run recorded fewer steps than it was asked for (it was stopped)."""
    planned = report.get("steps_planned")
    return f"of {planned} " if planned and report["steps"] < planned else ""


def resumed_note(report: dict[str, Any]) -> str:
    """What a resumed run's totals cover (empty for a run started once)."""
    n = report.get("invocations", 1)
    if n <= 1:
        return ""
    return (
        f" Resumed: this is the run's invocation {n}; the time counts this invocation, the "
        "totals and the table the whole run."
    )


def _ci(gain: dict[str, Any]) -> str:
    """``95 % CI +0.359 … +0.609``: a gain's interval."""
    low, high = gain["ci95"]
    return f"95 % CI {low:+.3f} … {high:+.3f}"


def heldout_gain_text(report: dict[str, Any]) -> str:
    """``Held-out reward 0.250 → 0.734: +0.484 (95 % CI +0.359 … +0.609, paired over 64
    tasks).`` and a blank line; empty without ``heldout_gain``."""
    gain = report.get("heldout_gain")
    if not gain:
        return ""
    return (
        f"Held-out reward {_f(report.get('heldout_reward_start'))} → "
        f"{_f(report.get('heldout_reward_last'))}: {gain['value']:+.3f} ({_ci(gain)}, "
        f"paired over {gain['n']} tasks).\n"
    )


REWARD_KEYS = (
    "reward_first_step",
    "reward_last_step",
    "heldout_reward_start",
    "heldout_reward_last",
)
"""The rewards the summary line shows."""


def summary_line(report: dict[str, Any]) -> str:
    """The run's totals in one line, as ``belayer run`` ends: rewards with three decimals
    (``-`` for none), the held-out change with its interval."""
    r = {k: _f(report.get(k)) or "-" for k in REWARD_KEYS}
    gain = report.get("heldout_gain")
    interval = f" ({gain['value']:+.3f}, {_ci(gain)} over {gain['n']} tasks)" if gain else ""
    return (
        f"steps {report['steps']}, trajectories {report['trajectories_completed']} "
        f"(lost {report['trajectories_lost']}), injected {report['failures_injected']}, "
        f"recovered {report['failures_recovered']}, env restores {report['env_restores']}, "
        f"handovers {report['handovers']}, trainer restarts {report['trainer_restarts']}, "
        f"weights v{report['weight_version']}, reward {r['reward_first_step']} → "
        f"{r['reward_last_step']}, held-out {r['heldout_reward_start']} → "
        f"{r['heldout_reward_last']}{interval}, "
        f"logprob diff max {report['logprob_diff_max']}, "
        f"{report['wall_seconds']:.0f} s"
    )


def machine_line(machine: dict[str, Any] | None) -> list[str]:
    """``report.md``'s line on the machine the run ran on (none for a report without one): on
    another CPU family the same run gives other numbers (docs/training.md)."""
    if not machine:
        return []
    return [f"Machine: {cpu_text(machine)}, torch {machine.get('torch')}.", ""]


def markdown(report: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """``report.md``: totals, the per-step table, the plots."""
    lines = [
        f"# belayer run {report['workload']} — {report['run_id']}",
        "",
        f"{report['steps']} {of_planned(report)}steps, {report['tasks']} tasks × {report['n']} "
        "samples per step, "
        f"model `{report['model_dir']}`, node recovery {report['recovery']}, "
        f"{'deterministic' if report.get('deterministic') else 'fast'} inference; "
        f"{report['wall_seconds']:.0f} s.{resumed_note(report)}",
        "",
        *(machine_line(report.get("machine"))),
        *([gain] if (gain := heldout_gain_text(report)) else []),
        "| total | value |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {report.get(k)} |" for k in CONTRACT]
    for k in ("heldout_reward_start", "heldout_reward_last", "restarts_from_scratch",
              "heldout_exact_start", "heldout_exact_last", "logprob_tokens_compared",
              "env_checkpoints", "weights_sha256", "inject"):  # fmt: skip
        lines.append(f"| {k} | {report.get(k)} |")
    lines += [
        "",
        "| step | reward | held-out | exact | tokens | rollout s | train s | push s | eval s | "
        "injected | recovered | logprob diff |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        lines.append(
            f"| {r['step']} | {_f(r.get('reward_mean'))} | {_f(r.get('heldout_reward'))} | "
            f"{_f(r.get('heldout_exact'))} | "
            f"{r.get('tokens', '')} | {_f(r.get('rollout_s'), 1)} | {_f(r.get('train_s'), 1)} | "
            f"{_f(r.get('push_s'), 2)} | {_f(r.get('eval_s'), 1)} | "
            f"{r.get('failures_injected', '')} | {r.get('failures_recovered', '')} | "
            f"{_g(r.get('logprob_diff_max'))} |"
        )
    if report.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in report["errors"]]
    lines += ["", "## Plots", ""]
    lines += [f"![{Path(p).stem}](plots/{Path(p).name})" for p in report.get("plots", [])]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, report: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """``report.json``, ``report.md`` and the plots (each failure logged, none raised)."""
    plots: list[str] = []

    def do_plots() -> None:
        plots.extend(make_plots(run_dir / "plots", records, report.get("timeline", [])))

    logs = RunLogs(run_dir, tensorboard=False)
    logs._guard("plots", do_plots)
    report["plots"] = plots
    text = json.dumps(report, indent=2, default=str) + "\n"
    logs._guard("report.json", lambda: (run_dir / "report.json").write_text(text))
    logs._guard("report.md", lambda: (run_dir / "report.md").write_text(markdown(report, records)))


# --- plots -----------------------------------------------------------------------------------
def make_plots(
    out: Path, records: list[dict[str, Any]], timeline: list[dict[str, Any]]
) -> list[str]:
    """The three PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    steps = [r for r in records if r.get("step", 0) >= 1]
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = [r["step"] for r in steps]
    ax.plot(xs, [r.get("reward_mean", 0) for r in steps], "o-", label="training (sampled) mean")
    held = [(r["step"], r["heldout_reward"]) for r in records if "heldout_reward" in r]
    if held:
        ax.plot([h[0] for h in held], [h[1] for h in held], "s--", label="held-out (greedy)")
    exact = [(r["step"], r["heldout_exact"]) for r in records if r.get("heldout_exact") is not None]
    if exact:
        ax.plot([e[0] for e in exact], [e[1] for e in exact], "^:", label="held-out exact (greedy)")
    ax.set_xticks(sorted({h[0] for h in held} | set(xs)))
    ax.set_xlabel("step (0: before training)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title("Reward per step")
    paths.append(_save(fig, out / "reward.png"))

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    bottom = [0.0] * len(steps)
    for key, label in (("rollout_s", "rollout"), ("reward_s", "reward"), ("train_s", "train"),
                       ("push_s", "push"), ("eval_s", "eval")):  # fmt: skip
        vals = [float(r.get(key, 0.0)) for r in steps]
        ax.bar(xs, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(xs)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    # Beside the bars, not over them, in the order of the stack (rollout at the bottom).
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title("Time per step")
    paths.append(_save(fig, out / "time.png"))

    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    for r in steps:
        if "t_start" in r and "t_end" in r:
            ax.axvspan(r["t_start"], r["t_end"], alpha=0.08 if r["step"] % 2 else 0.16)
            ax.text((r["t_start"] + r["t_end"]) / 2, 0.98, str(r["step"]), ha="center",
                    va="top", fontsize=7, transform=ax.get_xaxis_transform())  # fmt: skip
    kinds = sorted({e["what"] for e in timeline})
    for i, kind in enumerate(kinds):
        pts = [e for e in timeline if e["what"] == kind]
        marker = "x" if any(p["type"] == "injected" for p in pts) else "o"
        ax.scatter([p["t"] for p in pts], [i] * len(pts), marker=marker, s=40)
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels(kinds, fontsize=7)
    if not kinds:  # an empty plot would leave a reader guessing
        ax.text(0.5, 0.5, "no failure injected, no recovery", ha="center", va="center",
                transform=ax.transAxes, fontsize=10, color="0.4")  # fmt: skip
    ax.set_xlabel("seconds into the run (shaded: steps)")
    ax.set_title("Injected failures (x) and recoveries (o)")
    ax.grid(axis="x", alpha=0.3)
    paths.append(_save(fig, out / "failures.png"))
    return paths


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
