"""``belayer soak`` end to end, as a user runs it: the command starts its own node (no node runs
from its run directory), loads it (generate requests and math rollouts through the
controller), injects every process fault kind on real processes, checks every request's and
trajectory's history and stops the node. The verdict must be PASS with 0 violations and every
kind fired and recovered; what the checker judged is read back from the history, and the
node's leftovers are looked for here as well. ``--train`` runs RL steps on the node's
trainer, killed among the rest. The swe workload adds a sandbox lane on real
Docker + CRIU and its faults: a sandbox killed, paused, a checkpoint interrupted mid-write. A
SIGTERM in the middle of a soak stops it and the node it started, leaving nothing behind."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from bench.soak_check import (
    CheckpointAcked,
    Fault,
    Reference,
    RolloutEnded,
    RolloutSubmitted,
    SandboxBack,
    Submitted,
    Trained,
    TrainerResumedSeen,
    TrainError,
    TrajectorySeen,
    load,
)
from common.config import SHM_DIR, shm_prefix
from services.environment.client import node_label
from tests.integration.env_helpers import require_docker
from tests.integration.node_helpers import BELAYER, run_id_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KINDS = (
    "worker-kill",
    "worker-hang",
    "shadow-kill",
    "router-kill",
    "weights-kill",
    "kv-kill",
    "controller-kill",
)


def soak_env(tmp_path: Path) -> dict[str, str]:
    """No node runs from the run directory (the soak starts one); its temporary run directory
    goes under the test's ``tmp_path``."""
    return {**os.environ, "BELAYER_HOME": str(tmp_path / "no-node"), "TMPDIR": str(tmp_path)}


def assert_nothing_left(run_id: str, tmp_path: Path) -> None:
    assert not run_id_processes(run_id), "processes of the soak's node left behind"
    assert not list(SHM_DIR.glob(f"{shm_prefix(run_id)}*")), "shared-memory files left behind"
    assert not list(tmp_path.glob("belayer-soak-*")), "the soak's node directory was left"


def run_soak(tmp_path: Path, kinds: tuple[str, ...], *extra: str) -> dict:
    """``belayer soak --json`` with one fault of each of ``kinds``: it passed, each fault
    recovered; the result."""
    out = tmp_path / "soak.json"
    args = ["soak", "--faults", str(len(kinds)), "--kinds", ",".join(kinds), *extra]
    args += ["--seed", "1", "--out", str(out), "--json"]
    proc = subprocess.run(
        [*BELAYER, *args], env=soak_env(tmp_path), capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, f"soak failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(proc.stdout)
    assert result == json.loads(out.read_text())
    assert result["verdict"] == "PASS" and result["violations"] == []
    rows = {r["kind"]: r for r in result["faults"]}
    assert set(rows) == set(kinds) and not result["kinds_not_fired"]
    for kind, row in rows.items():
        assert row["count"] == 1 and row["recovered"] == 1, (kind, row)
        assert row["back_p50_s"] is not None and row["back_p50_s"] <= row["recover_p50_s"]
    assert result["finished"] == result["requests"] > 0
    return result


def assert_rollouts(records: list) -> None:
    """Every rollout the soak submitted ended, each slot published exactly once."""
    subs = [r for r in records if isinstance(r, RolloutSubmitted)]
    ends = {r.rid: r for r in records if isinstance(r, RolloutEnded)}
    assert subs and all(ends[s.rid].error == "" for s in subs)
    for s in subs:
        slots = sorted(
            t.slot for t in records if isinstance(t, TrajectorySeen) and t.rollout == s.rid
        )
        assert s.slots > 0 and slots == list(range(s.slots)), (s.rid, slots)


def test_a_short_soak_passes_with_every_fault_kind(tmp_path: Path) -> None:
    result = run_soak(tmp_path, KINDS, "--duration", "35", "--workload", "math")

    # The history holds what was judged: the mixed load, each request's reference, each fault.
    records = load(Path(result["history"]))
    subs = [r for r in records if isinstance(r, Submitted)]
    assert {s.stream for s in subs} == {True, False}
    assert {s.temperature > 0 for s in subs} == {True, False}
    assert len({s.max_tokens for s in subs}) > 2
    refs = {r.rid for r in records if isinstance(r, Reference) and not r.error}
    assert refs == {s.rid for s in subs}
    assert sorted(f.kind for f in records if isinstance(f, Fault)) == sorted(KINDS)
    assert_rollouts(records)
    assert_nothing_left(result["node"]["run_id"], tmp_path)

    # The kept history checks again on its own; one token changed in it is caught.
    history = Path(result["history"])
    again = recheck(history, tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout)["violations"] == []
    lines = history.read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if '"type":"finished"' in x and '"tokens":[]' not in x)
    rec = json.loads(lines[i])
    rec["tokens"][0] += 1
    lines[i] = json.dumps(rec)
    bad = tmp_path / "tampered.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    failed = recheck(bad, tmp_path)
    assert failed.returncode == 1
    found = {(v["invariant"], v["subject"]) for v in json.loads(failed.stdout)["violations"]}
    assert ("reference", rec["rid"]) in found


@pytest.mark.docker
def test_sandbox_faults_of_the_swe_workload_are_recovered(tmp_path: Path) -> None:
    """The sandbox lane's sandbox killed and paused, its checkpoint interrupted mid-write: each
    time it came back holding an acknowledged checkpoint's state; the swe rollouts through the
    controller published every slot once; no container is left."""
    docker_client = require_docker()
    kinds = ("sandbox-kill", "sandbox-pause", "checkpoint-interrupt")
    result = run_soak(
        tmp_path, kinds, "--duration", "15", "--workload", "swe", "--concurrency", "2"
    )
    records = load(Path(result["history"]))
    faults = {f.kind: f for f in records if isinstance(f, Fault)}
    assert faults["checkpoint-interrupt"].target == "environment (mid-write)"
    backs = [b for b in records if isinstance(b, SandboxBack)]
    assert len(backs) >= len(kinds)
    for b in backs:  # restored to what was acknowledged, and the file is that checkpoint's
        assert b.prefix >= b.acked and (b.prefix == 0 or b.content == str(b.prefix)), b
    acked = [c for c in records if isinstance(c, CheckpointAcked)]
    assert acked and max(c.t for c in acked) > max(f.t for f in faults.values())
    assert_rollouts(records)
    run_id = result["node"]["run_id"]
    assert_nothing_left(run_id, tmp_path)
    left = docker_client.containers.list(
        all=True, filters={"label": f"belayer.node={node_label(run_id)}"}
    )
    assert not left, "sandbox containers left behind"


def test_a_training_soak_passes_with_trainer_kills(tmp_path: Path) -> None:
    """``--workload math --train``: real RL steps on the node's trainer while it, the weight
    store, the controller and a worker are killed; every trajectory trained was published and
    trained once, the steps strictly increased, and the lane trained again after the trainer
    was killed and resumed; the weights did not move (learning rate 1e-12)."""
    kinds = ("trainer-kill", "weights-kill", "controller-kill", "worker-kill")
    result = run_soak(tmp_path, kinds, "--duration", "30", "--workload", "math", "--train")
    records = load(Path(result["history"]))
    steps = [r for r in records if isinstance(r, Trained)]
    assert result["trained_steps"] == len(steps) >= 1
    ids = [t for s in steps for t in s.trajectory_ids]
    assert result["trained_trajectories"] == len(ids) == len(set(ids))
    assert set(ids) <= {t.trajectory_id for t in records if isinstance(t, TrajectorySeen)}
    assert [s.step for s in steps] == sorted({s.step for s in steps})
    kill = next(f for f in records if isinstance(f, Fault) and f.kind == "trainer-kill")
    assert any(r.t > kill.t for r in records if isinstance(r, TrainerResumedSeen))
    assert any(s.t > kill.t for s in steps)
    assert not [e for e in records if isinstance(e, TrainError)]
    assert len({s.weights_sha256 for s in steps if s.weights_sha256}) == 1
    assert_rollouts(records)
    assert_nothing_left(result["node"]["run_id"], tmp_path)


def recheck(history: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``belayer soak --check HISTORY --json`` (no node)."""
    return subprocess.run(
        [*BELAYER, "soak", "--check", str(history), "--out", str(tmp_path / "re.json"), "--json"],
        env=soak_env(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_sigterm_stops_the_soak_and_the_node_it_started(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*BELAYER, "soak", "--faults", "50", "--duration", "300", "--kinds", "worker-kill",
         "--out", str(tmp_path / "soak.json")],
        env=soak_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for x in proc.stderr or []:
            lines.put(x)

    reader = threading.Thread(target=pump)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("fault 1/" in x for x in seen):  # a fault injected, the load running
            assert proc.poll() is None, "".join(seen)
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=30)  # the pipe closed: every line is in the queue
    while not lines.empty():
        seen.append(lines.get())
    text = "".join(seen)
    assert "error: interrupted" in text and "Traceback" not in text
    match = re.search(r"node ([0-9a-f]+):", text)
    assert match, text
    assert_nothing_left(match.group(1), tmp_path)
