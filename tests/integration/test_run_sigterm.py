"""SIGTERM to ``belayer run`` (a job scheduler's stop, ``kill``, ``timeout``) does what Ctrl-C
does — also when the run was started in a shell's background, where SIGINT is ignored: the
node the run started is stopped — no supervisor, nats-server or service process,
no shared-memory file of its run left — the report is written, and the command exits 143;
``--resume`` then goes on with every step recorded once."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from common.config import RunPaths
from common.heartbeat import process_alive
from common.node import read_node
from services.rl.node import shut_down
from services.rl.report import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def processes_under(root: Path) -> list[str]:
    """Command lines of live processes that name ``root`` (the run's node directory)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(root) in cmd and state != "Z":
            out.append(cmd)
    return out


def ignore_sigint() -> None:
    """What a non-interactive shell does to a command it starts with ``&``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_stops_the_node_the_run_started(
    warm_model: Callable[[str], Path], tmp_path: Path, sigint: str
) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "BELAYER_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "run", "math", "--steps", "50",
         "--model", str(warm_model("math")), "--out", str(out), "--held-out", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=ignore_sigint if sigint == "ignored" else None,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stderr or ():
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        while not any(x.strip().startswith("step 1:") for x in seen):  # a step trained
            seen.append(lines.get(timeout=180))
        node = read_node(RunPaths(out / "node"))
        assert node is not None and process_alive(node.supervisor_pid)
        if sigint == "ignored":  # meanwhile, a second invocation on the same run is refused
            check_refused_while_running(out, env, warm_model("math"), proc.pid)
            assert process_alive(node.supervisor_pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=30)  # stderr closed: every line is in the queue
    seen += list(lines.queue)
    assert code == 143, "".join(seen)
    assert any(x.startswith("stopped after step ") for x in seen), "".join(seen[-20:])
    assert not process_alive(node.supervisor_pid)
    assert processes_under(out / "node") == []
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"belayer-{node.run_id}")]
    report = json.loads((out / "report.json").read_text())
    assert 1 <= report["steps"] < 50
    if sigint == "default":
        check_resume(out, env, warm_model("math"), report["steps"])


def run_math(
    env: dict[str, str], model: Path, out: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """``belayer run math`` on ``model`` into ``out`` (2 held-out tasks) to its end."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", "math", "--model", str(model),
         "--out", str(out), "--held-out", "2", *args],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip


def check_refused_while_running(out: Path, env: dict[str, str], model: Path, pid: int) -> None:
    """``--resume`` of a run another invocation is training: one line, nothing touched."""
    proc = run_math(env, model, out, "--resume", "--steps", "60")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is being trained by another `belayer run` (pid {pid})" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def check_resume(out: Path, env: dict[str, str], model: Path, recorded: int) -> str:
    """``--resume`` one step further: wherever the signal landed (a step's rollout, its
    update, its push or evaluation after the trainer's checkpoint), the metrics hold every step
    once, in order."""
    steps = recorded + 1
    proc = run_math(env, model, out, "--resume", "--steps", str(steps), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["steps"] == steps
    assert [r["step"] for r in report["per_step"]] == list(range(steps + 1))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(steps + 1))
    # the new node's weight versions go on where the stopped run's left off: one per step
    versions = [r["weight_version"] for r in report["per_step"] if r["step"] >= 1]
    assert versions == list(range(versions[0], versions[0] + steps)), versions
    return proc.stderr


def test_a_sigkilled_run_leaves_no_node_and_resumes(
    warm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """SIGKILL cannot be handled: the node stops itself when the run's process is gone (its
    supervisor watches it), and ``--resume`` goes on."""
    out = tmp_path / "run"
    env = {**os.environ, "BELAYER_HOME": str(tmp_path / "home")}
    model = warm_model("math")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "run", "math", "--steps", "50",
         "--model", str(model), "--out", str(out), "--held-out", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        for line in proc.stderr or ():
            if line.strip().startswith("step 1:"):  # a step trained and recorded
                break
        node = read_node(RunPaths(out / "node"))
        assert node is not None and process_alive(node.supervisor_pid)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 90
    while processes_under(out / "node") and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the node's shutdown, bounded
    left = processes_under(out / "node")
    shut_down(RunPaths(out / "node"), timeout=30.0)  # what a failed check would leave running
    assert left == []
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"belayer-{node.run_id}")]
    check_resume(out, env, model, len(read_metrics(out / "metrics.jsonl")) - 1)


def test_a_node_left_running_in_the_run_directory_is_stopped_before_a_resume(
    warm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "BELAYER_HOME": str(tmp_path / "home")}
    model = warm_model("math")
    first = run_math(env, model, out, "--steps", "1", "--keep-node")
    assert first.returncode == 0, first.stderr[-4000:]
    kept = read_node(RunPaths(out / "node"))
    assert kept is not None and process_alive(kept.supervisor_pid)
    try:
        said = check_resume(out, env, model, 1)
    finally:
        shut_down(RunPaths(out / "node"), timeout=30.0)
    assert "stopping the node an earlier invocation left running" in said
    assert not process_alive(kept.supervisor_pid)
    assert processes_under(out / "node") == []
    check_clean_stops(out / "node" / "logs")


def check_clean_stops(logs: Path) -> None:
    """Both nodes stopped gracefully, each after a trained step: no service's connection drain
    ran out its time (the trainer's pull subscription once held it for 5 s at every stop), and
    no traceback reached a service's output."""
    timeouts = [
        line
        for f in sorted(logs.glob("*.jsonl"))
        for line in f.read_text().splitlines()
        if '"disconnect_timeout"' in line
    ]
    assert timeouts == []
    outs = {f.name: f.read_text() for f in sorted(logs.glob("*.out"))}
    assert "trainer.out" in outs
    assert {name: text for name, text in outs.items() if "Traceback" in text} == {}
