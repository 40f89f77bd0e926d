"""``belayer top`` in a real terminal (tmux): the view shows the node's engine, then — after the
main worker is SIGKILLed — the handover among the latest events and the engine's new worker;
it rides through a router SIGKILL (the router panel says it is not answering, then shows the
restarted router); ``q`` quits it. ``--once`` prints one frame without a terminal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.integration.node_helpers import Node, cli

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def tmux() -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    binary = shutil.which("tmux")
    assert binary, "tmux is not installed (deploy/install_env.sh installs it)"
    sock = f"belayer-top-{uuid.uuid4().hex[:8]}"

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [binary, "-L", sock, *args], capture_output=True, text=True, timeout=20, check=check
        )

    try:
        yield run
    finally:
        run("kill-server", check=False)


def _screen_until(
    tmux: Callable[..., subprocess.CompletedProcess[str]],
    want: Callable[[str], bool],
    what: str,
    timeout: float,
) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux("capture-pane", "-p", "-t", "top").stdout
        if want(screen):
            return screen
        time.sleep(0.25)  # the view refreshes every 0.5 s: read the screen as a person would
    raise AssertionError(f"no {what} on the screen within {timeout:.0f} s; it shows:\n{screen}")


def test_top_shows_a_handover_and_quits_on_q(node: Node, tmux) -> None:
    # The pane's own size (160x60), not COLUMNS/LINES the test process may carry (80x24 under
    # pytest), which rich would prefer.
    cmd = (
        f"env -u COLUMNS -u LINES {sys.executable} -m services.cli.main top --interval 0.5 "
        f"--run-dir {node.run_dir}"
    )
    tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "60", "-c", os.getcwd(), cmd)
    first = _screen_until(tmux, lambda s: "engines" in s and " e0 " in s, "engine row", 60)
    epoch_line = next(line for line in first.splitlines() if " e0 " in line)
    worker = node.pids()["worker-e0"]
    assert str(worker) in epoch_line
    os.kill(worker, signal.SIGKILL)
    after = _screen_until(tmux, lambda s: "handover_complete" in s, "handover event", 60)
    assert "handover_detected" in after
    _screen_until(
        tmux,
        lambda s: any(" e0 " in ln and str(worker) not in ln for ln in s.splitlines()),
        "new worker",
        30,
    )
    # The router SIGKILLed: its panel says so, the view goes on, and the restarted one shows.
    old_router = next(ln for ln in after.splitlines() if ln.startswith("router "))
    os.kill(node.pids()["router"], signal.SIGKILL)
    _screen_until(tmux, lambda s: "router: not answering" in s, "router outage", 30)
    _screen_until(tmux, lambda s: any(ln.startswith("router ") and ln.split(":")[0] != old_router.split(":")[0]
                                      for ln in s.splitlines()), "restarted router", 60)  # fmt: skip
    tmux("send-keys", "-t", "top", "q")
    deadline = time.monotonic() + 20
    while tmux("has-session", "-t", "top", check=False).returncode == 0:
        assert time.monotonic() < deadline, "top did not quit on q"
        time.sleep(0.1)  # waiting for the process to exit on its own


def test_top_once_prints_a_frame(node: Node) -> None:
    out = cli("top", "--once", run_dir=node.run_dir, timeout=60)
    assert "engines" in out.stdout and "e0" in out.stdout and "trainer" in out.stdout


def test_top_over_nats_url_with_creds_shows_the_last_rollout(node: Node, tmp_path) -> None:
    """From another directory, with only the bus URL and the client identity's seed: the
    rollouts panel shows the last rollout as the controller reports it."""
    args = ("rollout", "math", "--tasks", "1", "--n", "2", "--max-tokens", "8", "--json")
    rollout = json.loads(cli(*args, run_dir=node.run_dir, timeout=180).stdout)
    creds = node.run_dir / "auth" / "client.nk"
    out = cli("top", "--once", "--run-dir", str(tmp_path), "--nats-url", node.nats_url,
              "--creds", str(creds), run_dir=tmp_path, timeout=60).stdout  # fmt: skip
    assert "e0" in out and "(client)" in out
    done = rollout["trajectories_completed"]
    assert f"{rollout['rollout_id']} (math) done: {done}/2 trajectories done" in out, out
    assert "sandboxes: the environment service does not answer" in out  # client may not list
