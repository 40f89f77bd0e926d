"""What every benchmark shares: progress lines, the result table, the JSON file, the machine.

Each benchmark module exposes ``main(json_path, **options) -> dict``: it measures (progress on
stderr via :func:`progress`; :func:`machine_at_start` says the machine first), then
:func:`publish` prints one table of :class:`Row` (:func:`print_table`) and writes the result
(:func:`write_json`), which it returns. Every result carries ``bench`` (its name),
``timestamp`` and ``machine`` (:func:`machine_info`; :func:`machine_after` adds the load at
the end); a benchmark with targets also carries ``targets`` (key → ``{"op", "bound"}``,
:func:`targets_json`), ``verdicts`` (key → ``PASS``/``MISS``/``UNSURE``) and ``intervals``
(key → the judged value's bootstrap 95 % interval, ``bench.stats``). :func:`write_json`
stamps every result with ``commit`` (the checkout's ``git rev-parse HEAD``, null outside a
git checkout) and ``date`` (``YYYY-MM-DD``): a copy kept as ``docs/bench/<bench>-<date>.json``
says what it measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.machine import cpu_model as cpu_model
from common.machine import loadavg
from common.machine import machine_info as machine_info

Target = tuple[str, float]
"""A target: (comparison, ``">="`` or ``"<="``; bound)."""

PASS = "PASS"
MISS = "MISS"
ROOT = Path(__file__).resolve().parents[1]
"""The checkout (or install) the benchmarks run from."""


def progress(bench_name: str, message: str) -> None:
    """One progress line on stderr (stdout carries the table, or the JSON with ``--json``)."""
    sys.stderr.write(f"[bench {bench_name}] {message}\n")
    sys.stderr.flush()


@dataclass(frozen=True)
class Row:
    """One line of a benchmark's table."""

    metric: str
    """What was measured, in words."""
    value: str
    """The measured value as shown (with its unit), ``n/a`` when not measured."""
    target: str = ""
    """The target as shown (``≤ 0.2 s``); empty for an informational row."""
    verdict: str = ""
    """``PASS``, ``MISS`` or empty (no target)."""


def verdict(value: float | None, target: Target) -> str:
    """``PASS`` when ``value`` meets ``target``; ``MISS`` when it does not or was not measured."""
    if value is None:
        return MISS
    op, bound = target
    if op not in (">=", "<="):
        raise ValueError(f"unknown comparison {op!r} (expected '>=' or '<=')")
    return PASS if (value >= bound if op == ">=" else value <= bound) else MISS


def target_text(target: Target, unit: str = "") -> str:
    """A target as shown in a table: ``≥ 150 tok/s``; unit ``%`` shows a fraction in percent."""
    op, bound = target
    sign = "≥" if op == ">=" else "≤"
    if unit == "%":
        return f"{sign} {bound * 100:g} %"
    if unit == "x":
        return f"{sign} {bound:g}x"
    return f"{sign} {bound:g} {unit}".rstrip()


def targets_json(targets: Mapping[str, Target]) -> dict[str, dict[str, Any]]:
    """The ``targets`` entry of a result: key → ``{"op": ..., "bound": ...}``."""
    return {key: {"op": op, "bound": bound} for key, (op, bound) in targets.items()}


def verdicts(targets: Mapping[str, Target], values: Mapping[str, float | None]) -> dict[str, str]:
    """The ``verdicts`` entry of a result: each target key in ``values`` → ``PASS``/``MISS``."""
    return {key: verdict(values[key], target) for key, target in targets.items() if key in values}


def print_table(title: str, rows: Iterable[Row]) -> None:
    """The benchmark's table (rich) on stdout, as it is at the time of the call."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_column("", justify="center")
    for row in rows:
        style = {PASS: "green", MISS: "bold red", "UNSURE": "yellow"}.get(row.verdict, "")
        shown = f"[{style}]{row.verdict}[/]" if style else row.verdict
        table.add_row(row.metric, row.value, row.target, shown)
    Console(file=sys.stdout).print(table)


def publish(
    bench_name: str,
    title: str,
    rows: Iterable[Row],
    json_path: Path | str,
    result: Mapping[str, Any],
) -> Path:
    """The end of every benchmark: its table on stdout (:func:`print_table`), its result
    written (:func:`write_json`) and a progress line saying where."""
    print_table(title, rows)
    path = write_json(json_path, result)
    progress(bench_name, f"wrote {path}")
    return path


def write_json(path: Path | str, result: Mapping[str, Any]) -> Path:
    """Write ``result`` as indented JSON (parents created; non-JSON values as ``str``), with
    ``commit`` and ``date`` (:func:`snapshot_stamp`) added where it has none; a ``dict``
    result gains them too (what the benchmark returns is what it wrote)."""
    stamp = {k: v for k, v in snapshot_stamp().items() if k not in result}
    if isinstance(result, dict):
        result.update(stamp)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, **stamp}, indent=2, default=str) + "\n")
    return path


def git_commit(root: Path = ROOT) -> str | None:
    """``git rev-parse HEAD`` of the checkout at ``root``; None outside a git checkout (an
    installed package) or without git."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = proc.stdout.strip()
    return commit if proc.returncode == 0 and len(commit) == 40 else None


def snapshot_stamp() -> dict[str, Any]:
    """What a kept copy of a result needs to say what it measured: ``commit`` and ``date``."""
    return {"commit": git_commit(), "date": time.strftime("%Y-%m-%d")}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def timestamp() -> str:
    """Local time, ISO 8601 with the UTC offset."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def machine_at_start(bench_name: str) -> dict[str, Any]:
    """:func:`machine_info` as a benchmark starts, its CPUs and load said in a progress line."""
    machine = machine_info()
    progress(bench_name, f"{machine['cpu_count']} CPUs, load average {machine['loadavg']}")
    return machine


def machine_after(machine: Mapping[str, Any]) -> dict[str, Any]:
    """The result's ``machine``: as it was at the start, with ``loadavg_after`` (the load as the
    benchmark ends: a busy spell during the run shows)."""
    return {**machine, "loadavg_after": loadavg()}
