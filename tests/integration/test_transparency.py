"""Failure transparency, end to end (``belayer bench transparency``, the real CLI): the same
deterministic 2-step math run — the warm-started tiny model, a fresh node each (nats-server,
weight store, KV arena, router, worker + shadow, controller, trainer) — once without failures
and once with a rollout worker SIGKILLed in step 1 and the trainer SIGKILLed mid-update in step
2, ends with the same weights' sha256; every step trained the same batch (its sha256) with the
same rewards and bitwise the same loss, and the weights moved.

The sandbox kill has a test of its own: the same 2-step swe run (the warm-started SWE model,
real Docker sandboxes) with a worker SIGKILL and trajectory #0's sandbox SIGKILLed after its
first action in step 1 and the trainer SIGKILLed in step 2 rolls out, scores and trains bitwise
the same batches and ends with the same weights. Its weights need not move: where every group
of a step is all solved or all unsolved, no step has a gradient (the math test above is the one
whose weights always move). What it caught: pytest's run time in the observations (``in 0.07s``) made a trajectory
regenerated after the sandbox restore see other text than the lost one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

TASKS, N, STEPS = 8, 2, 2
INJECT = "worker-kill@step=1,trainer-kill@step=2"
BENCH_TIMEOUT_S = 400.0
"""Bound on both runs (about 2 minutes on a quiet 2-core machine; much more under load)."""


def bench(tmp: Path, *args: str) -> tuple[int, str, str]:
    """``belayer bench transparency ARGS``; past the bound, Ctrl-C for the whole process group
    (each ``belayer run`` then stops the node it started), then a failure. Its temporary
    directory is made under ``tmp`` (``TMPDIR``): the runs a MISS keeps for diagnosis — ~280 MB,
    mostly trainer checkpoints — stay with the test's own files, not in ``/tmp``."""
    cmd = [sys.executable, "-m", "services.cli.main", "bench", "transparency", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"bench transparency ran past {BENCH_TIMEOUT_S:g} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def test_a_worker_kill_and_a_trainer_kill_leave_no_trace_in_the_weights(
    warm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = warm_model("math")
    out = tmp_path / "transparency.json"
    code, stdout, stderr = bench(
        tmp_path, "--workload", "math", "--steps", str(STEPS), "--model", str(model),
        "--tasks", str(TASKS), "--n", str(N), "--held-out", "1", "--inject", INJECT,
        "--out", str(out), "--json",
    )  # fmt: skip
    assert code == 0, stderr[-4000:]
    result = json.loads(stdout)
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
    assert any(s["grad_norm"] for s in result["per_step"])  # the weights moved: compared something
    assert result["verdict"] == "PASS", result["problems"]


SWE_INJECT = "worker-kill@step=1,sandbox-kill@step=1,trainer-kill@step=2"
SWE_SEED = 1000
"""The demonstrated instances: the model's episodes there are short (about a minute a run)."""


@pytest.mark.docker
def test_a_sandbox_kill_leaves_no_trace_in_what_is_trained(
    warm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = warm_model("swe")
    out = tmp_path / "transparency-swe.json"
    code, stdout, stderr = bench(
        tmp_path, "--workload", "swe", "--steps", "2", "--seed", str(SWE_SEED),
        "--model", str(model), "--tasks", "2", "--n", "2", "--held-out", "1",
        "--inject", SWE_INJECT, "--out", str(out), "--json",
    )  # fmt: skip
    assert code == 0, stderr[-4000:]
    result = json.loads(stdout)
    faulted = result["runs"]["faulted"]
    assert result["runs"]["clean"]["errors"] == [] and faulted["errors"] == []
    assert sorted(faulted["fired"]) == sorted(SWE_INJECT.split(",")), faulted
    assert faulted["failures_recovered"] == 3 and faulted["trainer_restarts"] == 1
    # the killed sandbox's trajectory was recovered (restored, or restarted from its image)
    assert faulted["env_restores"] + faulted["restarts_from_scratch"] >= 1, faulted
    for s in result["per_step"]:
        assert len(s["rewards"]["clean"]) == 4
        for what in ("batch_sha256", "rewards", "loss", "weights_sha256"):
            assert s[what]["faulted"] == s[what]["clean"], (what, s)
    # the one problem allowed: no gradient (every reward 0), so the weights could not differ
    assert result["problems"] in (
        [],
        ["no step of the clean run had a gradient: the weights never moved"],
    )
