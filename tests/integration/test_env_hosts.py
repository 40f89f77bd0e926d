"""Environment hosts (issue 24 item 2), on real processes: one nats-server with the
identities of `belayer auth init --env-host ha --env-host hb`, a node joined to it without an
environment of its own (the warm-started tiny SWE model), and two environment hosts joined
with `belayer up --role env-host` (separate run directories, so separate checkpoint
directories and node labels; this machine's dockerd serves both).

Sandboxes are placed on both hosts by free capacity. Once the controller has recorded a
ready checkpoint of a sandbox on a host, that host dies: its supervisor and environment service SIGKILLed, its containers
removed. Every trajectory completes; every sandbox of the dead host that had a ready
checkpoint is restored on the other host from the object store, and its trajectory continues
from L_k — none restarts from scratch while a ready checkpoint was known."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common import subjects
from common.auth import BusConfig
from common.bus import connect, request
from common.codec import decode
from common.natsserver import NatsServer, start_nats_server
from schemas.env import EnvRestore, EnvRestored
from schemas.events import AnyEvent, CheckpointReady, SandboxRestored
from schemas.rollout import RolloutRequest, TrajectoryState
from schemas.serving import SamplingParams
from services.controller.client import submit, trajectories, wait
from services.environment.client import PlacedEnvClient
from services.environment.docker_ops import LABEL_NODE
from tests.integration.env_helpers import require_docker, running_env
from tests.integration.node_helpers import Node, cli, run_id_processes, stop_node

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(600)]

TASKS = ["kv_daemon", "shop_total", "calc_clamp"]
"""Bundled SWE tasks whose solutions take more than one action."""


@dataclass
class Deployment:
    server: NatsServer
    auth: Path
    node: Node
    hosts: dict[str, Node]
    """Host directory name (``ha``, ``hb``) → its env host."""

    def bus(self, identity: str, where: str = "node") -> BusConfig:
        return BusConfig(creds=str(self.auth / where / f"{identity}.nk"))


def warm_swe_model(root: Path) -> Path:
    """The warm-started tiny SWE model (cached by the model layer after its first build);
    ``BELAYER_TEST_SWE_MODEL`` names an already made one instead."""
    given = os.environ.get("BELAYER_TEST_SWE_MODEL")
    if given:
        return Path(given)
    out = root / "swe"
    proc = cli("model", "init", "--tiny", "--warm-start", "swe", str(out),
               run_dir=root, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, f"warm start failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def start_host(name: str, url: str, auth: Path, run_dir: Path) -> Node:
    cli(
        "up", "--detach", "--join", url, "--role", "env-host", "--creds-dir", str(auth / name),
        run_dir=run_dir, timeout=180,
    )  # fmt: skip
    info = json.loads((run_dir / "node.json").read_text())
    return Node(run_dir=run_dir, nats_url=info["nats_url"], run_id=info["run_id"])


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    require_docker()
    root = tmp_path_factory.mktemp("envhosts")
    model = warm_swe_model(root / "model")
    auth = root / "auth"
    cli("auth", "init", str(auth), "--env-host", "ha", "--env-host", "hb", run_dir=root)
    server = start_nats_server(root / "nats", authorization=(auth / "auth.conf").read_text())
    nodes: list[Node] = []
    try:
        node_dir = root / "node"
        cli(
            "up", "--detach", "--no-environment", "--join", server.url, "--creds-dir",
            str(auth / "node"), "--model", str(model), run_dir=node_dir, timeout=240,
        )  # fmt: skip
        info = json.loads((node_dir / "node.json").read_text())
        node = Node(run_dir=node_dir, nats_url=info["nats_url"], run_id=info["run_id"])
        nodes.append(node)
        names = ("ha", "hb")
        with ThreadPoolExecutor(2) as pool:  # the two hosts start side by side
            started = pool.map(lambda n: start_host(n, server.url, auth, root / n), names)
            hosts = dict(zip(names, started, strict=True))
        nodes += hosts.values()
        yield Deployment(server, auth, node, hosts)
    finally:
        with ThreadPoolExecutor(2) as pool:
            list(
                pool.map(
                    lambda n: cli("down", run_dir=n.run_dir, timeout=90, check=False), nodes[1:]
                )
            )
        if nodes:
            stop_node(nodes[0])
        server.stop()


def kill_host(host: Node) -> int:
    """SIGKILL every process of the host (its supervisor first, so that nothing restarts
    the environment service), then remove its containers: the host is gone. Returns how many
    containers were removed."""
    import docker

    supervisor = json.loads((host.run_dir / "node.json").read_text())["supervisor_pid"]
    os.kill(supervisor, signal.SIGKILL)  # first: nothing restarts the environment service
    for _ in range(20):  # bounded: a process the supervisor started meanwhile goes too
        pids = run_id_processes(host.run_id)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not run_id_processes(host.run_id), "a process of the killed host is left"
    client = docker.DockerClient(version="auto", timeout=30)
    label = f"{LABEL_NODE}=node-{host.run_id}"
    gone = client.containers.list(all=True, filters={"label": label})
    for c in gone:
        c.remove(force=True)
    return len(gone)


class Watch:
    """Every event of the deployment (core subscription) and every durable trajectory state
    the controller writes (KV ``trajectory_prefix``) while the test runs."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.states: dict[str, TrajectoryState] = {}
        self.changed = asyncio.Event()
        self._watcher: Any = None
        self._pump: asyncio.Task[None] | None = None

    async def start(self, nc: Any) -> Watch:
        async def cb(msg: Any) -> None:
            with contextlib.suppress(Exception):
                self.seen.append(decode(msg.data, AnyEvent))
                self.changed.set()

        await nc.subscribe(subjects.EVENTS_ALL, cb=cb)
        kv = await nc.jetstream().key_value(subjects.BUCKET_TRAJECTORY_PREFIX)
        self._watcher = await kv.watchall(include_history=False)
        self._pump = asyncio.create_task(self.pump())
        return self

    async def pump(self) -> None:
        async for entry in self._watcher:
            if entry is not None and entry.value:
                st = decode(entry.value, TrajectoryState)
                self.states[st.trajectory_id] = st
                self.changed.set()

    async def stop(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await self._watcher.stop()

    async def until(self, find: Any, timeout: float) -> Any:
        """The first non-empty ``find()``, looked for again on every new event or state."""

        async def loop() -> Any:
            while True:
                self.changed.clear()
                hit = find()
                if hit:
                    return hit
                await self.changed.wait()

        return await asyncio.wait_for(loop(), timeout)


async def test_an_env_host_dies_and_its_sandboxes_continue_on_the_other(
    deployment: Deployment,
) -> None:
    d = deployment
    nc = await connect(d.server.url, name="t", bus=d.bus("operator"))
    # `up --role env-host` returns once its host is registered (placeable), not when any host
    # answers `env.list`: both hosts are placed on from the first sandbox.
    placeable = {h.host for h in await PlacedEnvClient(nc).hosts(now=True)}
    assert placeable == {f"node-{h.run_id}" for h in d.hosts.values()}, placeable
    watch = await Watch().start(nc)
    try:
        request = RolloutRequest(
            workload="swe", rollout_id="envhosts", task_ids=TASKS, n=2, policy="always",
            sampling=SamplingParams(temperature=1.0, max_tokens=128), seed=11,
        )  # fmt: skip
        accepted = await submit(nc, request)
        labels = {f"environment:node-{h.run_id}": name for name, h in d.hosts.items()}

        def host_of() -> dict[str, str]:
            """Sandbox → the env host whose ready checkpoint the controller recorded."""
            source = {
                e.checkpoint.sandbox_id: labels[e.source]
                for e in watch.seen
                if isinstance(e, CheckpointReady) and e.source in labels
            }
            return {
                st.sandbox_id: source[st.sandbox_id]
                for st in watch.states.values()
                if st.status == "running" and st.ready and st.sandbox_id in source
            }

        # The first host to hold a sandbox whose ready checkpoint the controller recorded dies.
        victim = next(iter((await watch.until(host_of, timeout=180)).values()))
        survivor = next(n for n in d.hosts if n != victim)
        ready = {  # sandbox → trajectory, of the dead host's sandboxes with a recorded C_k
            sid: tid for sid, tid in ((st.sandbox_id, t) for t, st in watch.states.items())
            if host_of().get(sid) == victim
        }  # fmt: skip
        placed = {h.host: h.sandboxes for h in await PlacedEnvClient(nc).hosts(now=True)}
        assert sorted(placed) == sorted(f"node-{h.run_id}" for h in d.hosts.values())
        assert all(n >= 1 for n in placed.values()), f"not placed across hosts: {placed}"
        assert kill_host(d.hosts[victim]) >= 1
        done = await wait(nc, accepted.rollout_id, timeout=400)
        s = done.summary
        assert (s.trajectories, s.trajectories_completed, s.trajectories_failed) == (6, 6, 0)
        got = {t.trajectory_id: t for t in await trajectories(nc, accepted.rollout_id, timeout=60)}
        assert len(got) == 6
        assert sum(t.recovery.restarts_from_scratch_with_checkpoint for t in got.values()) == 0
        survivor_src = f"environment:node-{d.hosts[survivor].run_id}"
        moved = {
            e.sandbox_id
            for e in watch.seen
            if isinstance(e, SandboxRestored) and e.source == survivor_src
        }
        for sandbox_id, trajectory_id in ready.items():
            t = got[trajectory_id]  # the same attempt: it was not restarted
            if t.recovery.sandbox_failures == 0:
                continue  # it ended before its next environment step needed the sandbox
            assert sandbox_id in moved, f"{sandbox_id} was not restored on {survivor}"
            assert t.recovery.restores >= 1 and t.recovery.restarts_from_scratch == 0
        assert any(got[tid].recovery.sandbox_failures for tid in ready.values()), (
            "no trajectory of the dead host needed its sandbox again"
        )
    finally:
        await watch.stop()
        await nc.close()


async def test_a_criu_checkpoint_moves_to_another_host_through_the_object_store(
    nc: Any, js: Any, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Two environment services (their own run and checkpoint directories): a sandbox with a
    running process, checkpointed by CRIU on its host, is taken over by the other host from
    the object store — the process runs on, the files are the checkpoint's."""
    url = nats_server.url
    async with (
        running_env(nc, url, tmp_path / "a", checkpoint_store=True) as a,
        running_env(nc, url, tmp_path / "b", checkpoint_store=True) as b,
    ):
        client = PlacedEnvClient(nc, timeout=60)
        for _ in range(100):  # bounded: both registrations are written at start-up
            if len(await client.hosts(now=True)) == 2:
                break
            await asyncio.sleep(0.1)
        sid = (await client.create(sandbox_id="move-me", trajectory_id="mv")).sandbox_id
        dst = b if client.where[sid] == a.config.node else a
        counter = "i=0; while true; do i=$((i+1)); echo $i > /root/t; mv /root/t /root/n; sleep 0.05; done"
        await client.exec(sid, f"echo kept > /root/f; (sh -c '{counter}' >/dev/null 2>&1 &)")
        info = await client.checkpoint(sid, 1, "mv")
        assert info.method != "layer"  # the counter runs: CRIU dumped it
        await client.exec(sid, "echo later > /root/f")  # not in the checkpoint
        moved = await request(
            nc, subjects.env_host(dst.config.node, "restore"),
            EnvRestore(sandbox_id=sid, checkpoint_id=info.checkpoint_id, from_store=True,
                       trajectory_id="mv"),
            EnvRestored, timeout=120,
        )  # fmt: skip
        assert moved.checkpoint_id == info.checkpoint_id and moved.method != "layer"
        assert (dst.config.checkpoint_root / sid / info.checkpoint_id / "manifest.json").is_file()
        other = PlacedEnvClient(nc, timeout=60)
        other.where[sid] = dst.config.node
        assert (await other.exec(sid, "cat /root/f")).stdout.strip() == "kept"
        first = int((await other.exec(sid, "cat /root/n")).stdout)
        for _ in range(100):  # bounded: the restored counter keeps counting
            now = int((await other.exec(sid, "cat /root/n")).stdout)
            if now > first:
                break
            await asyncio.sleep(0.05)
        assert now > first >= 1
        await other.destroy(sid)
        await client.destroy(sid)  # the source host's copy (its host did not really die)
