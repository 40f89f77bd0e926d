"""Failure transparency, end to end (``belayer bench transparency``, the real CLI): the same
deterministic 2-step math run — the warm-started tiny model, a fresh node each (nats-server,
weight store, KV arena, router, worker + shadow, controller, trainer) — once without failures
and once with a rollout worker SIGKILLed in step 1 and the trainer SIGKILLed mid-update in step
2, ends with the same weights' sha256; every step trained the same batch (its sha256) with the
same rewards and bitwise the same loss, and the weights moved.

No sandbox kill here: a swe run needs the SWE model's sandboxes (minutes per run on 2 cores);
``belayer bench transparency --workload swe`` covers it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(330)]

TASKS, N, STEPS = 8, 2, 2
INJECT = "worker-kill@step=1,trainer-kill@step=2"
BENCH_TIMEOUT_S = 300.0


def test_a_worker_kill_and_a_trainer_kill_leave_no_trace_in_the_weights(
    warm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = warm_model("math")
    out = tmp_path / "transparency.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "bench", "transparency", "--workload", "math",
         "--steps", str(STEPS), "--model", str(model), "--tasks", str(TASKS), "--n", str(N),
         "--held-out", "1", "--inject", INJECT, "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    clean, faulted = result["runs"]["clean"], result["runs"]["faulted"]
    # both runs trained every step deterministically; only the second one failed, twice
    assert clean["steps"] == faulted["steps"] == STEPS
    assert clean["deterministic"] and faulted["deterministic"]
    assert clean["failures_injected"] == 0 and clean["errors"] == []
    assert faulted["failures_injected"] == 2 == faulted["failures_recovered"], faulted
    assert faulted["handovers"] >= 1 and faulted["trainer_restarts"] == 1
    # what training learnt does not show it
    weights = result["weights_sha256"]
    assert len(weights["clean"]) == 64 and weights["faulted"] == weights["clean"]
    assert [s["step"] for s in result["per_step"]] == list(range(1, STEPS + 1))
    for s in result["per_step"]:
        assert s["equal"], s
        assert len(s["rewards"]["clean"]) == TASKS * N
        assert s["rewards"]["faulted"] == s["rewards"]["clean"]
        assert s["loss"]["faulted"] == s["loss"]["clean"]
        assert s["batch_sha256"]["faulted"] == s["batch_sha256"]["clean"]
    hashes = [s["weights_sha256"]["clean"] for s in result["per_step"]]
    assert len(set(hashes)) == STEPS  # the weights moved every step: something was compared
    assert result["verdict"] == "PASS", result["problems"]
