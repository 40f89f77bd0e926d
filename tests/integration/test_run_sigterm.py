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
from collections.abc import Callable
from pathlib import Path

import pytest

from common.config import RunPaths
from common.heartbeat import process_alive
from common.node import read_node
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


def check_resume(out: Path, env: dict[str, str], model: Path, recorded: int) -> None:
    """``--resume`` one step further: wherever the signal landed (a step's rollout, its
    update, its push or evaluation after the trainer's checkpoint), the metrics hold every step
    once, in order."""
    steps = recorded + 1
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", "math", "--resume", "--steps",
         str(steps), "--model", str(model), "--out", str(out), "--held-out", "2", "--json"],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["steps"] == steps
    assert [r["step"] for r in report["per_step"]] == list(range(steps + 1))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(steps + 1))
