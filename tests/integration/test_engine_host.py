"""Engines on a second host (issue 24 item 3): `belayer up --role engine-host` joins a node
with its own run directory, weight store (a mirror of the node's versions, fetched through the
JetStream Object Store) and KV arena; its engine serves the node's requests, survives its
worker's SIGKILL through its shadow, and switches to a version the trainer pushes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from common import events
from common.codec import decode
from common.config import SHM_DIR, shm_prefix
from schemas.events import WorkerWeightsSwapped
from services.weights.client import fetch_manifest, map_weights, push_weights
from tests.integration.node_helpers import (
    Node,
    StreamRecord,
    cli,
    greedy,
    log_lines,
    router_status,
    run_id_processes,
    start_node,
    stop_node,
    stream_generate,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

REMOTE = "h1-e0"


def start_engine_host(node: Node, run_dir: Path) -> Node:
    """The engine host `h1`, joined to ``node`` with the identities the node made for it."""
    cli(
        "up", "--detach", "--role", "engine-host", "--host-name", "h1", "--join", node.nats_url,
        "--creds-dir", str(node.run_dir / "auth" / "h1"), "--deterministic",
        run_dir=run_dir, timeout=180,
    )  # fmt: skip
    info = json.loads((run_dir / "node.json").read_text())
    assert info["role"] == "engine-host" and info["engines"] == [REMOTE]
    return Node(run_dir=run_dir, nats_url=info["nats_url"], run_id=info["run_id"])


def stop_engine_host(host: Node) -> None:
    cli("down", run_dir=host.run_dir, timeout=60)
    assert not list(SHM_DIR.glob(f"{shm_prefix(host.run_id)}*")), "shm files left behind"
    assert not run_id_processes(host.run_id), "a process of the engine host is left"


async def scenario(node: Node, host: Node) -> None:
    nc = await node.connect(identity="client")
    trainer = await node.connect(name="push", identity="trainer")
    try:
        # The remote engine serves exactly what the node's own engine serves (same weights).
        ref = await stream_generate(nc, greedy("ref", n=96, engine_id="e0"))
        remote = await stream_generate(nc, greedy("remote", n=96, engine_id=REMOTE))
        assert remote.result is not None and remote.result.engine_ids == [REMOTE]
        assert remote.tokens == ref.tokens and remote.result.weight_version == 1
        assert log_lines(host, "weights", "weights_mirrored")

        # Its main worker SIGKILLed mid-request: the shadow takes over, the tokens are exact.
        old_pid = {e.id: e.worker_pid for e in (await router_status(nc)).engines}[REMOTE]
        rec = StreamRecord("killed")
        task = asyncio.create_task(
            stream_generate(nc, greedy("killed", n=96, engine_id=REMOTE), record=rec)
        )
        await rec.wait_tokens(8, timeout=60)
        os.kill(old_pid, signal.SIGKILL)
        done = await asyncio.wait_for(task, 120)
        assert done.tokens == ref.tokens, "the taken-over request differs"
        assert done.result is not None and done.result.engine_ids[0] == REMOTE

        async def promoted() -> bool:
            info = {e.id: e for e in (await router_status(nc)).engines}[REMOTE]
            return info.worker_pid != old_pid and info.state == "up"

        await wait_until(promoted, timeout=60, what="the shadow serves the remote engine")

        # A pushed version reaches the engine host's store and its engine serves it.
        swaps: list[WorkerWeightsSwapped] = []

        async def on_swap(msg: Any) -> None:
            swaps.append(decode(msg.data, WorkerWeightsSwapped))

        await nc.subscribe(events.subject(WorkerWeightsSwapped), cb=on_swap)
        manifest = await fetch_manifest(trainer)
        state = {k: v.clone() for k, v in map_weights(manifest).items()}
        with torch.no_grad():
            for v in state.values():
                if v.is_floating_point():
                    v.mul_(1.5)
        pushed = await push_weights(trainer, state, manifest.version, run_id=node.run_id)

        def switched() -> bool:
            return any(
                s.engine_id == REMOTE and s.version == pushed.version and s.role == "main"
                for s in swaps
            )

        await wait_until(switched, timeout=60, what="the remote engine switched versions")
        after_local = await stream_generate(nc, greedy("v2-local", n=48, engine_id="e0"))
        after = await stream_generate(nc, greedy("v2-remote", n=48, engine_id=REMOTE))
        assert after.result is not None and after.result.weight_version == pushed.version
        assert (
            after_local.result is not None and after_local.result.weight_version == pushed.version
        )
        assert after.tokens == after_local.tokens  # the mirrored bytes are the node's
        mirrored = [r["version"] for r in log_lines(host, "weights", "weights_mirrored")]
        assert pushed.version in mirrored
    finally:
        await trainer.close()
        await nc.close()


def test_an_engine_host_serves_survives_a_worker_kill_and_follows_pushes(tmp_path: Path) -> None:
    node = start_node(tmp_path / "node", "--engine-host", "h1:1", "--deterministic")
    try:
        host = start_engine_host(node, tmp_path / "h1")
        try:
            asyncio.run(scenario(node, host))
        finally:
            stop_engine_host(host)
        st = node.status()
        assert st["state"] == "ready"
    finally:
        stop_node(node)
