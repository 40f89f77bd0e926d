"""``belayer soak``'s report: check the history, the table per fault kind, the verdict, the
JSON result."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import soak_check as sc
from bench.report import Row, machine_info, print_table, timestamp
from bench.report import progress as report_progress
from bench.soak_train_check import trained_counts

if TYPE_CHECKING:
    from bench.soak import SoakOptions


def progress(message: str) -> None:
    report_progress("soak", message)


def report(opts: SoakOptions, records: list[sc.Record], info: dict[str, Any]) -> dict[str, Any]:
    """Check the history, print the table per fault kind and the verdict; the JSON result."""
    violations = sc.check(records)
    rows = sc.fault_table(records)
    slow = [w for w in sc.request_waits(records) if w.wait_s > sc.SLOW_S]
    finished = [r for r in records if isinstance(r, sc.Finished)]
    kinds = info.get("kinds", [])
    not_fired = [k for k in kinds if k not in {r.kind for r in rows}]
    trained_steps, trained_trajectories = trained_counts(records)
    verdict = "PASS" if not violations and not not_fired and finished else "FAIL"
    result: dict[str, Any] = {
        "bench": "soak",
        "timestamp": timestamp(),
        "options": {
            k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(opts).items()
        },
        "node": {k: v for k, v in info.items() if k != "shm_before"},
        "machine": machine_info(),
        "requests": len([r for r in records if isinstance(r, sc.Submitted)]),
        "finished": len(finished),
        "tokens": sum(len(r.tokens) for r in finished),
        "trained_steps": trained_steps,
        "trained_trajectories": trained_trajectories,
        "faults": [dataclasses.asdict(r) for r in rows],
        "kinds_not_fired": not_fired,
        "slow_requests": [dataclasses.asdict(w) for w in slow],
        "violations": [dataclasses.asdict(v) for v in violations],
        "verdict": verdict,
        "history": str(opts.history_path),
    }
    print_kinds(rows)
    by: dict[str, int] = {}
    for v in violations:
        by[v.invariant] = by.get(v.invariant, 0) + 1
    summary = [
        Row("requests (finished)", f"{result['requests']} ({result['finished']})"),
        Row("tokens delivered", str(result["tokens"])),
        Row("train steps (trajectories trained)", f"{trained_steps} ({trained_trajectories})"),
        Row(f"requests waiting > {sc.SLOW_S:g} s after a fault (flagged)", str(len(slow))),
        *(Row(f"violations: {name}", str(by.get(name, 0)), "0", "PASS" if not by.get(name) else "MISS")
          for name in sc.INVARIANTS),
        Row("fault kinds that did not fire", ", ".join(not_fired) or "none", "none",
            "PASS" if not not_fired else "MISS"),
        Row("verdict", verdict, "", verdict if verdict == "PASS" else "MISS"),
    ]  # fmt: skip
    print_table("belayer soak", summary)
    for v in violations[:20]:
        progress(f"violation {v.invariant} [{v.subject}]: {v.detail}")
    return result


def _s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def print_kinds(rows: list[sc.KindRow]) -> None:
    """The table per fault kind (rich) on stdout."""
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"faults (slow: a stream waited > {sc.SLOW_S:g} s for its next token)")
    heads = ("kind", "n", "not injected", "recovered", "back p50 s", "back p99 s",
             "whole p50 s", "whole p99 s", "hit", "slow", "max wait s")  # fmt: skip
    for col in heads:
        table.add_column(
            col, justify="left" if col == "kind" else "right", no_wrap=col in ("kind", "recovered")
        )
    for r in rows:
        table.add_row(
            r.kind, str(r.count), str(r.not_injected), str(r.recovered), _s(r.back_p50_s),
            _s(r.back_p99_s), _s(r.recover_p50_s), _s(r.recover_p99_s), str(r.requests_hit), str(r.slow),
            _s(r.wait_max_s),
        )  # fmt: skip
    width = max(110, shutil.get_terminal_size((110, 24)).columns)  # 11 columns: not squeezed
    Console(file=sys.stdout, width=width).print(table)
