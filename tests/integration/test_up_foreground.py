"""``belayer up`` in the foreground: Ctrl-C or SIGTERM drains the node and returns; a SIGKILL
of the command (which it cannot handle) stops the node too — its supervisor watches the
command's process — so in every case no service, nats-server or shared-memory file of the
node is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from common.config import RunPaths
from common.heartbeat import process_alive
from common.node import NodeInfo, read_node
from services.rl.node import shut_down
from tests.integration.node_helpers import run_id_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def with_sigint() -> None:
    """A terminal's foreground job: SIGINT at its default (a test runner started in a shell's
    background would pass it on ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def up_in_foreground(run_dir: Path, model: Path) -> tuple[subprocess.Popen[str], NodeInfo]:
    """``belayer up`` (foreground, one engine, no sandboxes) and its node once ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "up", "--run-dir", str(run_dir),
         "--engines", "1", "--no-environment", "--model", str(model)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=with_sigint,
    )  # fmt: skip
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        node = read_node(RunPaths(run_dir))
        if node is not None and node.ready:
            return proc, node
        time.sleep(0.2)  # polling the node file until the node says ready, bounded
    proc.kill()
    out, _ = proc.communicate()
    pytest.fail(f"belayer up did not get ready (exit {proc.returncode}):\n{out[-3000:]}")


def gone(node: NodeInfo, within: float) -> bool:
    """Whether every process of the node (its run id in their environment) and every
    shared-memory file of its run is gone within ``within`` seconds."""
    deadline = time.monotonic() + within

    def running() -> bool:
        return bool(run_id_processes(node.run_id)) or process_alive(node.supervisor_pid)

    while running() and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the node's shutdown, bounded
    shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"belayer-{node.run_id}")]
    return not running() and not shm


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_a_foreground_node_stops_with_its_command(
    warm_model: Callable[[str], Path], tmp_path: Path, how: str
) -> None:
    run_dir = tmp_path / "node"
    proc, node = up_in_foreground(run_dir, warm_model("math"))
    try:
        assert run_id_processes(node.run_id)  # what `gone` checks sees the node's processes
        if how in ("ctrl-c", "sigterm"):
            proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGTERM)
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode == 0, out[-3000:]
            assert "stopping the node" in out
        else:
            proc.kill()
            proc.wait(timeout=10)
        assert gone(node, within=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shut_down(RunPaths(run_dir), timeout=30.0)  # whatever a failed check left running
