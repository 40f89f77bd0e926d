"""A reward service written in Node.js (``reward_service.mjs``: nats.js + @msgpack/msgpack,
installed from npm by this test's setup, written from docs/protocol.md §5.1 alone) scores a
math rollout through the real bus with the node's ``reward`` identity (it answers an error to a
request without the response's token ids or the trajectory id, so no reward failure means every
request carried them), then a rollout of the example plugin's ``make_judged`` workload, which
names the service itself (``rewards``, no ``--reward``); once it is stopped, the same math
rollout completes with every trajectory's reward failed — recorded and counted, never read
as 0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.node_helpers import Node, cli, start_node, stop_node

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
PACKAGES = ("nats@2.29.3", "@msgpack/msgpack@3.1.3")
NAME = "exact"
EXAMPLE = HERE.parents[1] / "examples" / "plugin"
JUDGED = "belayer_example_tasks:make_judged"
"""The example plugin's workload that declares ``rewards = ["service:exact"]``."""


@pytest.fixture(scope="module")
def reward_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node enabling the example plugin (on the PYTHONPATH its processes inherit)."""
    with pytest.MonkeyPatch.context() as mp:
        path = os.environ.get("PYTHONPATH", "")
        mp.setenv("PYTHONPATH", f"{EXAMPLE}{os.pathsep}{path}" if path else str(EXAMPLE))
        started = start_node(tmp_path_factory.mktemp("reward"), "--workload-plugin", JUDGED)
        try:
            yield started
        finally:
            stop_node(started)


def npm_modules() -> Path:
    """nats.js and @msgpack/msgpack in a cache dir (installed once, from the npm registry)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "Node.js and npm are needed (deploy/install_env.sh installs them)"
    root = Path.home() / ".cache" / "belayer" / "node-reward-service"
    if (
        not (root / "node_modules" / "nats").is_dir()
        or not (root / "node_modules" / "@msgpack").is_dir()
    ):
        root.mkdir(parents=True, exist_ok=True)
        (root / "package.json").write_text(
            '{"name": "belayer-reward-test", "private": true, "type": "module"}'
        )
        subprocess.run([npm, "install", "--silent", "--no-audit", "--no-fund", *PACKAGES],
                       cwd=root, check=True, timeout=240)  # fmt: skip
    return root


@pytest.fixture
def service(reward_node: Node, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    root = npm_modules()
    script = root / "reward_service.mjs"  # beside its node_modules, so imports resolve
    shutil.copy(HERE / "reward_service.mjs", script)
    count = tmp_path / "served"
    seed = reward_node.run_dir / "auth" / "reward.nk"
    argv = ["node", str(script), reward_node.nats_url, str(seed), NAME, str(count)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()  # blocks until the service has subscribed
    assert line.startswith(f"ready {NAME}"), line
    try:
        yield proc, count
    finally:
        proc.kill()
        proc.wait()


def _rollout(node: Node, workload: str = "math") -> dict:
    args = ["rollout", workload, "--tasks", "2", "--n", "2", "--max-tokens", "16", "--json"]
    if workload == "math":
        args += ["--reward", f"service:{NAME}"]
    return dict(json.loads(cli(*args, run_dir=node.run_dir, timeout=180).stdout))


def test_a_node_js_reward_service_scores_a_rollout_and_its_absence_is_counted(
    reward_node: Node, service
) -> None:
    node, (proc, count) = reward_node, service
    result = _rollout(node)
    assert result["trajectories_completed"] == 4 and result["reward_failures"] == 0
    assert all(
        row["reward"] in (0.0, 1.0) and row["reward_error"] == "" for row in result["trajectories"]
    )
    assert count.read_text() == "4"  # one request per trajectory, answered by the Node.js service

    judged = _rollout(node, JUDGED)  # no --reward: the workload's own `rewards` names the service
    assert judged["trajectories_completed"] == 4 and judged["reward_failures"] == 0
    assert all(row["reward_error"] == "" for row in judged["trajectories"])
    assert count.read_text() == "8"

    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    gone = _rollout(node)
    assert gone["trajectories_completed"] == 4 == gone["reward_failures"]
    assert gone["trajectories_failed"] == 0
    for row in gone["trajectories"]:
        assert (
            "did not answer" in row["reward_error"] and f"service='{NAME}'" in row["reward_error"]
        )
    assert gone["mean_reward"] is None  # nothing was scored: no mean (not a mean of 0)
    assert time.monotonic() - t0 < 120
