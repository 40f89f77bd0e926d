"""Multi-host: three nats-server processes on loopback as one cluster (TLS for clients and
routes, the identities of `belayer auth init`, JetStream R3), a node joined to it with
`belayer up --join`; generation and a rollout run through it while one server is SIGKILLed,
and no request or trajectory is lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.soak_cluster import listening_pid
from common import subjects
from common.auth import BusConfig
from common.bus import connect
from common.errors import BelayerError, Unauthorized
from common.heartbeat import process_alive
from common.natsserver import ClusterSpec, NatsServer, TlsFiles, free_port, start_nats_server
from schemas.rollout import RolloutRequest
from services.controller.client import submit, trajectories, wait
from services.router.client import generate
from tests.integration.node_helpers import (
    Node,
    StreamRecord,
    cli,
    greedy,
    run_id_processes,
    stop_node,
)
from tests.integration.tls_helpers import Pki, make_pki

pytestmark = pytest.mark.timeout(420)


@dataclass
class Cluster:
    servers: list[NatsServer]
    pki: Pki
    auth: Path
    node: Node

    @property
    def urls(self) -> str:
        return ",".join(s.url for s in self.servers)

    def bus(self, identity: str) -> BusConfig:
        return BusConfig(
            creds=str(self.auth / "node" / f"{identity}.nk"),
            tls_ca=str(self.pki.ca),
            tls_cert=str(self.pki.cert),
            tls_key=str(self.pki.key),
        )


def start_cluster(root: Path, pki: Pki, authorization: str) -> list[NatsServer]:
    ports, route_ports = [free_port() for _ in range(3)], [free_port() for _ in range(3)]
    routes = tuple(f"nats-route://127.0.0.1:{p}" for p in route_ports)
    tls = TlsFiles(cert=str(pki.cert), key=str(pki.key), ca=str(pki.ca))
    servers: list[NatsServer] = []
    try:
        for i in range(3):
            spec = ClusterSpec(
                name="belayer", server_name=f"n{i}", port=route_ports[i], routes=routes
            )
            servers.append(
                start_nats_server(
                    root / f"n{i}",
                    port=ports[i],
                    authorization=authorization,
                    tls=tls,
                    cluster=spec,
                )
            )
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


async def jetstream_ready(urls: str, bus: BusConfig, timeout: float = 60.0) -> None:
    """Until the cluster's JetStream answers (its meta leader is elected)."""
    nc = await connect(urls, name="probe", bus=bus)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await nc.jetstream().account_info()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)  # bounded wait for the cluster's leader election
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    auth, run_dir = root / "auth", root / "run"
    cli("auth", "init", str(auth), "--engines", "1", "--env-host", "sandboxes", run_dir=run_dir)
    pki = make_pki(root / "tls")
    servers = start_cluster(root, pki, (auth / "auth.conf").read_text())
    try:
        c = Cluster(servers, pki, auth, Node(run_dir, "", ""))
        asyncio.run(jetstream_ready(c.urls, c.bus("client")))
        cli(
            "up", "--detach", "--no-environment", "--join", c.urls, "--creds-dir",
            str(auth / "node"), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key),
            "--tls-ca", str(pki.ca), "--replicas", "3", run_dir=run_dir, timeout=240,
        )  # fmt: skip
        info = json.loads((run_dir / "node.json").read_text())
        c.node = Node(run_dir=run_dir, nats_url=info["nats_url"], run_id=info["run_id"])
        try:
            yield c
        finally:
            stop_node(c.node)
    finally:
        for s in servers:
            s.stop()
            stop_restarted(s.port)


def stop_restarted(port: int) -> None:
    """A server a soak started again (not this process's child) still serving ``port``:
    SIGTERM it and wait until it is gone."""
    pid = listening_pid(port)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # bounded wait for its shutdown
    if process_alive(pid):
        os.kill(pid, signal.SIGKILL)


async def test_streams_are_replicated_and_tls_is_required(cluster: Cluster) -> None:
    nc = await connect(cluster.urls, name="t", bus=cluster.bus("operator"))
    try:
        js = nc.jetstream()
        for stream in (
            subjects.STREAM_TOKENS,
            subjects.STREAM_REQUESTS,
            subjects.STREAM_EVENTS,
            subjects.STREAM_TRAJECTORIES,
            "KV_" + subjects.BUCKET_ENGINE_EPOCHS,
            "KV_" + subjects.BUCKET_ROLLOUTS,
        ):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2, stream
    finally:
        await nc.close()
    # Without the CA the servers' certificates are not trusted; without TLS nothing connects.
    no_ca = BusConfig(creds=cluster.bus("client").creds)
    with pytest.raises(BelayerError):
        await connect(cluster.servers[0].url, name="x", bus=no_ca, timeout=3, reconnect=False)
    plain = cluster.servers[0].url.replace("tls://", "nats://")
    with pytest.raises(BelayerError):
        await connect(plain, name="x", bus=no_ca, timeout=3, reconnect=False)
    # ... and TLS without an identity is refused too.
    anon = BusConfig(
        tls_ca=str(cluster.pki.ca), tls_cert=str(cluster.pki.cert), tls_key=str(cluster.pki.key)
    )
    with pytest.raises(Unauthorized):
        await connect(cluster.servers[0].url, name="x", bus=anon, timeout=3, reconnect=False)
    st = json.loads(cli("status", "--json", run_dir=cluster.node.run_dir).stdout)
    assert st["state"] == "ready" and [e["healthy"] for e in st["engines"]] == [True]


async def test_one_server_dies_mid_run_and_nothing_is_lost(cluster: Cluster) -> None:
    nc = await connect(cluster.urls, name="t", bus=cluster.bus("client"))
    try:
        reqs = [greedy(f"cl-{i}", f"cluster prompt {i}", n=48) for i in range(6)]
        ref = {r.request_id: (await generate(nc, greedy(f"ref-{r.request_id}", r.prompt or "", n=48))).token_ids for r in reqs}  # fmt: skip
        rollout = RolloutRequest(workload="math", rollout_id="cluster-roll", tasks=2, n=2, seed=3)
        accepted = await submit(nc, rollout)
        records = {r.request_id: StreamRecord(r.request_id) for r in reqs}

        def collect(rid: str):
            return lambda d: records[rid].tokens.extend(d.token_ids)

        tasks = [
            asyncio.create_task(generate(nc, r, timeout=240, on_delta=collect(r.request_id)))
            for r in reqs
        ]
        deadline = time.monotonic() + 120
        while sum(len(r.tokens) for r in records.values()) < 12:
            assert time.monotonic() < deadline, "no tokens before the kill"
            await asyncio.sleep(0.02)  # bounded wait until the requests are mid-stream
        # The server this caller is connected to: its streams must fail over too.
        assert nc.connected_url is not None
        killed = next(x for x in cluster.servers if x.port == nc.connected_url.port)
        killed.process.kill()
        killed.process.wait(10)
        results = await asyncio.gather(*tasks)
        for r, res in zip(reqs, results, strict=True):
            assert res.token_ids == ref[r.request_id], r.request_id
            assert records[r.request_id].tokens == res.token_ids  # each token once, in order
        done = await wait(nc, accepted.rollout_id, timeout=240)
        s = done.summary
        assert (s.trajectories, s.trajectories_completed, s.trajectories_failed) == (4, 4, 0)
        got = await trajectories(nc, accepted.rollout_id, timeout=60)
        assert sorted(t.slot for t in got) == [0, 1, 2, 3]
        assert nc.connected_url is not None and nc.connected_url.port != killed.port
        st = json.loads(cli("status", "--json", run_dir=cluster.node.run_dir).stdout)
        assert st["state"] == "ready"
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


@pytest.mark.docker
def test_an_env_host_joins_and_serves_the_nodes_sandboxes(cluster: Cluster, tmp_path: Path) -> None:
    """`belayer up --join … --role env-host` on another "host" (run dir, its own identities
    from `belayer auth init --env-host`): only the environment service runs there, and the
    node's operator creates, runs and destroys a sandbox through the cluster. `belayer down`
    on the env host stops only it."""
    from tests.integration.env_helpers import require_docker

    require_docker()
    host_dir = tmp_path / "env-host"
    pki = cluster.pki
    cli(
        "up", "--detach", "--join", cluster.urls, "--role", "env-host", "--creds-dir",
        str(cluster.auth / "sandboxes"), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key),
        "--tls-ca", str(pki.ca), run_dir=host_dir, timeout=180,
    )  # fmt: skip
    info = json.loads((host_dir / "node.json").read_text())
    host = Node(run_dir=host_dir, nats_url=info["nats_url"], run_id=info["run_id"])
    try:
        assert info["role"] == "env-host" and info["engines"] == []
        names = {p.name for p in (host_dir / "logs").glob("*.jsonl")}
        assert "environment.jsonl" in names and "router.jsonl" not in names
        node_dir = cluster.node.run_dir
        sandbox = cli("env", "create", run_dir=node_dir, timeout=120).stdout.strip()
        out = cli("env", "exec", sandbox, "echo from-the-env-host", run_dir=node_dir, timeout=120)
        assert "from-the-env-host" in out.stdout
        cli("env", "destroy", sandbox, run_dir=node_dir, timeout=120)
    finally:
        cli("down", run_dir=host_dir, timeout=90)
    assert not run_id_processes(host.run_id), "a process of the env host is left"
    st = json.loads(cli("status", "--json", run_dir=cluster.node.run_dir).stdout)
    assert st["state"] == "ready"  # the node itself kept running


def test_the_documented_cluster_configs_are_valid(tmp_path: Path) -> None:
    """`deploy/cluster/nats-N.conf` with this machine's paths: nats-server accepts each."""
    from common.auth import authorization_conf, ensure_identities, node_identities
    from common.natsserver import nats_server_binary

    root = Path(__file__).resolve().parents[2] / "deploy" / "cluster"
    pki = make_pki(tmp_path / "tls")
    idents = ensure_identities(tmp_path / "auth", node_identities(["e0"]))
    (tmp_path / "auth.conf").write_text(authorization_conf(idents))
    for i in (1, 2, 3):
        text = (root / f"nats-{i}.conf").read_text()
        for path, real in (
            ("/etc/belayer/tls/host.pem", pki.cert),
            ("/etc/belayer/tls/host-key.pem", pki.key),
            ("/etc/belayer/tls/ca.pem", pki.ca),
            ("/var/lib/belayer/nats", tmp_path / f"store{i}"),
        ):
            assert path in text
            text = text.replace(path, str(real))
        conf = tmp_path / f"nats-{i}.conf"
        conf.write_text(text)
        r = subprocess.run(
            [nats_server_binary(), "-t", "-c", str(conf)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, r.stderr + r.stdout
        assert 'include "auth.conf"' in text


def test_a_soak_kills_and_restarts_cluster_servers_and_loses_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`belayer soak --kinds nats-kill` on the node joined to the cluster: each fault SIGKILLs
    one of the three servers (found by the port it listens on) and starts it again as it was
    started; every request of the load finishes once with its fault-free reference's tokens
    (the soak's checker), each server is back and the node whole after each fault."""
    # An earlier test of this module kills a server for good: start it again first.
    for s in cluster.servers:
        if s.process.poll() is not None:
            s.process = subprocess.Popen(
                s.process.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
    asyncio.run(jetstream_ready(cluster.urls, cluster.bus("client")))
    before = {s.port: s.process.pid for s in cluster.servers}
    out = tmp_path / "soak.json"
    proc = cli(
        "soak", "--kinds", "nats-kill", "--faults", "3", "--duration", "24", "--concurrency",
        "2", "--seed", "2", "--out", str(out), "--json", run_dir=cluster.node.run_dir,
        timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"soak failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(proc.stdout)
    assert result["verdict"] == "PASS" and result["violations"] == [], result["violations"]
    (row,) = result["faults"]
    assert row["kind"] == "nats-kill" and row["count"] == 3 and row["recovered"] == 3, row
    assert row["not_injected"] == 0 and row["back_p50_s"] <= row["recover_p50_s"]
    assert result["finished"] == result["requests"] > 0
    # Each server was killed once (three faults, taken in turn) and runs again under a new pid.
    after = {port: listening_pid(port) for port in before}
    assert all(after[p] not in (None, before[p]) for p in before), (before, after)
    st = json.loads(cli("status", "--json", run_dir=cluster.node.run_dir).stdout)
    assert st["state"] == "ready"
