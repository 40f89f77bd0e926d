"""``bench transparency``'s verdict arithmetic (pure): what counts as equal, what makes a MISS."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

from bench.transparency import compare, default_inject, interrupt, problems_of

CHILD = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a run started in a shell's background has it
def stop(signum, frame):
    print("stopped its node")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
signal.pause()
"""


def report(
    losses: list[float], *, inject: list[str] | None = None, grad: float = 0.5
) -> dict[str, Any]:
    steps = [
        {"step": i + 1, "weights_sha256": f"w{loss}", "batch_sha256": "b", "rewards": [0.0, 1.0],
         "loss": loss, "grad_norm": grad, "inject": inject or []}
        for i, loss in enumerate(losses)
    ]  # fmt: skip
    fired = [{"type": "injected", "detail": i} for i in inject or []]
    return {"per_step": [{"step": 0}, *steps], "errors": [], "inject": inject or [],
            "failures_injected": len(inject or []), "timeline": fired}  # fmt: skip


def test_equal_runs_pass_and_a_differing_step_is_named() -> None:
    clean, faulted = report([0.1, 0.2]), report([0.1, 0.2], inject=["worker-kill@step=1"])
    rows = compare(clean, faulted, 2)
    assert all(r["equal"] for r in rows) and problems_of(clean, faulted, rows) == []
    moved = report([0.1, 0.3], inject=["worker-kill@step=1"])
    rows = compare(clean, moved, 2)
    assert [r["equal"] for r in rows] == [True, False]
    assert problems_of(clean, moved, rows) == ["step 2: weights_sha256, loss differ"]


def test_nothing_compared_is_a_miss() -> None:
    clean = report([0.0], grad=0.0)
    assert not compare(clean, report([0.0]), 2)[1]["equal"]  # a step missing on both sides
    rows = compare(clean, clean, 1)
    problems = problems_of(clean, clean, rows)
    assert "no failure fired in the faulted run: nothing was compared" in problems
    assert any("never moved" in p for p in problems)
    unfired = report([0.0], inject=["trainer-kill@step=1"])
    unfired["timeline"] = []
    assert "no trainer-kill fired in the faulted run" in problems_of(report([0.0]), unfired, rows)


def test_every_kind_is_injected_and_worker_and_shadow_kills_never_share_a_step() -> None:
    math = default_inject("math", 3).split(",")
    assert {i.split("@")[0] for i in math} == {"worker-kill", "controller-kill", "shadow-kill",
                                               "trainer-kill"}  # fmt: skip
    swe = default_inject("swe", 2).split(",")
    assert {"sandbox-kill", "sandbox-pause"} <= {i.split("@")[0] for i in swe}
    for spec in (math, swe):
        at = {i.split("@")[0]: i.split("@")[1] for i in spec if "step=" in i}
        assert at["worker-kill"] != at["shadow-kill"]
    assert all(i.endswith("step=1") for i in default_inject("math", 1).split(","))


def test_a_stopped_run_gets_to_stop_its_node_even_with_sigint_ignored() -> None:
    """``interrupt`` asks a ``belayer run`` to stop in a way it hears however it was started:
    a child that ignores SIGINT (inherited from a shell's background) stops on its own, with
    its handler's output, instead of being killed and leaving its node behind."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    out, _ = interrupt(proc, grace_s=30.0)
    assert proc.returncode == 143 and out == "stopped its node\n"
    assert proc.returncode != -signal.SIGKILL
