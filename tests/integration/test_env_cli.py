"""The environment service inside a node (`belayer up --environment`) driven through the CLI:
create → exec → checkpoint → kill the container → restore → ls --json → destroy, with the
public JSON fields of `env ls --json`; and `belayer down` leaving no sandbox container, no
checkpoint directory, no process and no shared-memory file — after a graceful stop and after
the node died (supervisor SIGKILLed, its environment service with it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.errors import BelayerError, BusUnavailable
from schemas.env import SandboxLimits
from services.environment.client import PlacedEnvClient, node_label
from tests.integration.env_helpers import (
    BUMP,
    COUNTER,
    START_COUNTER,
    leftover_containers,
    require_docker,
)
from tests.integration.node_helpers import (
    Node,
    cli,
    pid_gone,
    start_node,
    stop_node,
    wait_until,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]
NODE_ARGS = ("--environment",)
"""The module's node (``tests/node_fixtures.py``): with the environment service."""


def env(node: Node, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return cli("env", *args, run_dir=node.run_dir, check=check)


def test_sandbox_lifecycle_through_the_cli(node: Node) -> None:
    sid = env(node, "create", "--memory-mb", "256").stdout.strip()
    try:
        env(node, "exec", sid, "echo one > /root/state; mkdir -p /root/d; echo x > /root/d/gone")
        ck = json.loads(env(node, "checkpoint", sid, "-k", "1", "--json").stdout)
        assert ck["prefix"] == 1 and ck["sandbox_id"] == sid
        env(node, "exec", sid, "echo two > /root/state; rm -r /root/d")
        listing = json.loads(env(node, "ls", "--json").stdout)
        (sb,) = [s for s in listing if s["id"] == sid]
        assert {"id", "container_id", "ready_prefix", "checkpoint_id"} <= sb.keys()
        assert sb["ready_prefix"] == 1 and sb["checkpoint_id"] == ck["checkpoint_id"]
        old_container = sb["container_id"]
        subprocess.run(["/usr/bin/docker", "kill", old_container], check=True, capture_output=True)
        restored = json.loads(env(node, "restore", sid, "--json").stdout)
        assert restored["prefix"] == 1
        out = env(node, "exec", sid, "cat /root/state /root/d/gone").stdout.split()
        assert out == ["one", "x"]  # files back to prefix 1, the deleted tree restored
        (sb,) = [s for s in json.loads(env(node, "ls", "--json").stdout) if s["id"] == sid]
        assert sb["container_id"] != old_container
    finally:
        env(node, "destroy", sid)
    assert all(s["id"] != sid for s in json.loads(env(node, "ls", "--json").stdout))


RESTART_PROBE_S = 10.0
"""The client's probe period in the test below: longer than the supervisor takes to restart
the environment service, so that no probe falls into the gap (no responder) between the two
processes and only the new process's ``boot`` can tell the client."""


async def test_an_operation_the_killed_environment_service_had_fails_at_the_next_probe(
    node: Node,
) -> None:
    """An operation in flight when the environment service is SIGKILLed and restarted by its
    supervisor is never answered: the request went to the dead process, and the new one
    answers pings. The client sees another process answer (``EnvHostInfo.boot``) and fails
    the operation with ``BusUnavailable`` at its next probe, not at its deadline (here 150 s;
    it stalled a swe rollout's recovery ~146 s in the sandbox soak)."""
    nc = await node.connect("test-env-restart", identity="operator")
    client = PlacedEnvClient(nc, timeout=30.0, probe_every_s=RESTART_PROBE_S)
    host = node_label(node.run_id)
    try:
        sid = (await client.create(limits=SandboxLimits(memory_mb=256))).sandbox_id
        first = await client.ping(host)
        assert first is not None and first.boot
        t0 = time.monotonic()
        op = asyncio.ensure_future(client.exec(sid, "sleep 120", timeout_s=120.0))

        async def sleeping() -> bool:  # the dead process must have had the operation
            out = await client.exec(sid, "pgrep -x sleep || true", timeout_s=5.0)
            return bool(out.stdout.strip())

        await wait_until(sleeping, timeout=10.0, what="the exec runs in the sandbox")
        os.kill(node.pids()["environment"], signal.SIGKILL)

        async def restarted() -> bool:  # pinged often, each ping bounded by 1 s
            with contextlib.suppress(BelayerError):
                info = await PlacedEnvClient(nc, probe_every_s=0.1).ping(host)
                return info is not None and info.boot != first.boot
            return False

        await wait_until(restarted, timeout=60.0, what="the restarted service answers")
        restart_s = time.monotonic() - t0
        with pytest.raises(BusUnavailable):
            await asyncio.wait_for(op, timeout=RESTART_PROBE_S + 10.0)
        failed_s = time.monotonic() - t0
        assert failed_s < 2 * RESTART_PROBE_S + 10.0, (restart_s, failed_s)
        await client.destroy(sid)
    finally:
        await nc.drain()


def test_cli_errors_are_clear(node: Node) -> None:
    r = env(node, "exec", "sb-missing", "true", check=False)
    assert r.returncode != 0 and "sb-missing" in r.stderr
    r = env(node, "restore", "sb-missing", check=False)
    assert r.returncode != 0 and "error" in r.stderr.lower()


def _checkpointed_sandbox(node: Node, tmp_path: Path) -> tuple[str, Path]:
    """One sandbox running a process, with a ready checkpoint at prefix 1; a second sandbox is
    checkpointed and destroyed (its checkpoint directory goes with it). Returns (sandbox id,
    checkpoint root)."""
    counter = tmp_path / "counter.py"
    counter.write_bytes(COUNTER)
    root = node.run_dir / "env" / "checkpoints"
    create = ("create", "--memory-mb", "256", "--file", f"{counter}:/root/counter.py")
    sid = env(node, *create).stdout.strip()
    env(node, "exec", sid, START_COUNTER)
    assert env(node, "exec", sid, BUMP).stdout.strip() == "1"
    ck = json.loads(env(node, "checkpoint", sid, "-k", "1", "--json").stdout)
    assert (root / sid / ck["checkpoint_id"]).is_dir()
    gone = env(node, "create", "--memory-mb", "128").stdout.strip()
    env(node, "checkpoint", gone, "-k", "1")
    assert (root / gone).is_dir()
    env(node, "destroy", gone)
    assert not (root / gone).exists(), "destroy left the sandbox's checkpoint directory"
    return sid, root


def _assert_no_sandbox_leftovers(node: Node, root: Path) -> None:
    client = require_docker()
    label = node_label(node.run_id)
    assert not leftover_containers(client, label), f"containers of {label} left behind"
    assert not list(root.iterdir()), f"checkpoint dirs left behind: {list(root.iterdir())}"
    records = node.run_dir / "env" / "sandboxes"
    assert not list(records.iterdir()), f"sandbox records left behind: {list(records.iterdir())}"


@pytest.mark.timeout(400)
def test_down_removes_the_nodes_sandboxes_and_checkpoints(tmp_path: Path) -> None:
    """Graceful: a SIGTERMed environment service destroys its sandboxes while it drains (the
    supervisor then restarts it, empty); `belayer down` leaves nothing of the node either."""
    require_docker()
    node = start_node(tmp_path / "run", "--environment")
    try:
        first, root = _checkpointed_sandbox(node, tmp_path)
        env_pid = node.pids()["environment"]
        os.kill(env_pid, signal.SIGTERM)
        wait_gone(env_pid)
        _assert_no_sandbox_leftovers(node, root)
        wait_serving(node)  # the restarted service
        assert json.loads(env(node, "ls", "--json").stdout) == []
        second, _ = _checkpointed_sandbox(node, tmp_path)
        assert leftover_containers(require_docker(), node_label(node.run_id))
    finally:
        stop_node(node)  # `belayer down`, then: no process, no shm file of the node
    _assert_no_sandbox_leftovers(node, root)
    assert not (root / first).exists() and not (root / second).exists()


@pytest.mark.timeout(400)
def test_down_after_the_node_died_removes_what_it_left(tmp_path: Path) -> None:
    """The supervisor SIGKILLed: its services die with it (the environment service too, so
    nobody destroyed the sandboxes) and its NATS server stays; `belayer down` finds the
    sandboxes by the node's label (from the node file) and removes them, their checkpoints and
    the NATS server."""
    require_docker()
    node = start_node(tmp_path / "run", "--environment")
    try:
        sid, root = _checkpointed_sandbox(node, tmp_path)
        info = json.loads((node.run_dir / "node.json").read_text())
        env_pid = node.pids()["environment"]
        os.kill(info["supervisor_pid"], signal.SIGKILL)
        for pid in (info["supervisor_pid"], env_pid):
            wait_gone(pid)
        assert leftover_containers(require_docker(), node_label(node.run_id))
        assert (root / sid).is_dir()
    finally:
        stop_node(node)
    _assert_no_sandbox_leftovers(node, root)


@pytest.mark.timeout(500)
def test_down_keep_sandboxes_then_up_adopts_them(tmp_path: Path) -> None:
    """`belayer down --keep-sandboxes` leaves the sandboxes running with their checkpoints; the
    next `belayer up` of the same run directory (a new run id, so a new node label) adopts
    them — the process inside kept its state — and a plain `belayer down` then removes them."""
    client = require_docker()
    run_dir = tmp_path / "run"
    first = start_node(run_dir, "--environment")
    second: Node | None = None
    try:
        sid, root = _checkpointed_sandbox(first, tmp_path)
        (sb,) = json.loads(env(first, "ls", "--json").stdout)
        out = cli("down", "--keep-sandboxes", run_dir=run_dir, timeout=60).stdout
        assert "1 sandboxes kept" in out
        assert client.api.inspect_container(sb["container_id"])["State"]["Running"]
        assert (root / sid / sb["checkpoint_id"]).is_dir()

        second = start_node(run_dir, "--environment")
        assert second.run_id != first.run_id
        (adopted,) = json.loads(env(second, "ls", "--json").stdout)
        assert (adopted["id"], adopted["container_id"]) == (sid, sb["container_id"])
        assert adopted["ready_prefix"] == 1 and adopted["state"] == "running"
        assert env(second, "exec", sid, BUMP).stdout.strip() == "2"  # the same process
        client.api.kill(sb["container_id"])
        assert json.loads(env(second, "restore", sid, "--json").stdout)["prefix"] == 1
        assert env(second, "exec", sid, BUMP).stdout.strip() == "2"  # the counter at prefix 1
    finally:
        stop_node(second or first)
    _assert_no_sandbox_leftovers(second or first, root)
    assert not leftover_containers(client, node_label(first.run_id))


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Until ``pid`` no longer runs (bounded)."""
    deadline = time.monotonic() + timeout
    while not pid_gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs after {timeout} s"
        time.sleep(0.05)  # bounded poll of another process's exit


def wait_serving(node: Node, timeout: float = 60.0) -> None:
    """Until the node's environment service answers ``env ls`` (bounded)."""
    deadline = time.monotonic() + timeout
    while env(node, "ls", check=False).returncode != 0:
        assert time.monotonic() < deadline, f"environment service not serving after {timeout} s"
        time.sleep(0.2)  # bounded poll of a restarting service
