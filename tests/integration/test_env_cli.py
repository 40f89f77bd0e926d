"""The environment service inside a node (`belayer up --environment`) driven through the CLI:
create → exec → checkpoint → kill the container → restore → ls --json → destroy, with the
public JSON fields of `env ls --json`."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.integration.env_helpers import require_docker
from tests.integration.node_helpers import Node, cli, start_node, stop_node

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    require_docker()
    n = start_node(tmp_path_factory.mktemp("envnode"), "--environment")
    try:
        yield n
    finally:
        stop_node(n)


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


def test_cli_errors_are_clear(node: Node) -> None:
    r = env(node, "exec", "sb-missing", "true", check=False)
    assert r.returncode != 0 and "sb-missing" in r.stderr
    r = env(node, "restore", "sb-missing", check=False)
    assert r.returncode != 0 and "error" in r.stderr.lower()
