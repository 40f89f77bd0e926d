"""The environment service SIGKILLed in the middle of a checkpoint: the previous ready pointer
stays in force, the partial directory is never used, a restarted service recovers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from common import subjects
from common.errors import BelayerError
from schemas.env import ReadyPointer, SandboxLimits
from services.environment.client import EnvClient
from tests.integration.env_helpers import BIG_PROCESS, leftover_containers, require_docker

pytestmark = [pytest.mark.docker]
ROOT = Path(__file__).resolve().parents[2]


def _spawn(url: str, run_dir: Path, node: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.environment",
            "--nats-url",
            url,
            "--run-dir",
            str(run_dir),
            "--node",
            node,
            "--log-file",
            str(log),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _wait_ready(c: EnvClient, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(300):
        assert proc.poll() is None, "environment service exited"
        with contextlib.suppress(BelayerError):
            await c.list()
            return
        await asyncio.sleep(0.1)
    raise AssertionError("environment service not ready in 30 s")


@pytest.mark.timeout(240)
async def test_service_killed_mid_checkpoint_keeps_previous_pointer(
    nc, js, nats_server, tmp_path
) -> None:
    docker_client = require_docker()
    node = "crash-" + secrets.token_hex(4)
    run_dir = tmp_path / "run"
    c = EnvClient(nc, timeout=60)
    proc = _spawn(nats_server.url, run_dir, node, tmp_path / "env1.log")
    proc2 = None
    try:
        await _wait_ready(c, proc)
        sid = (await c.create(limits=SandboxLimits(memory_mb=768))).sandbox_id
        await c.exec(
            sid,
            "echo one > /root/f; " + BIG_PROCESS,
        )
        first = await c.checkpoint(sid, 1)
        await c.exec(sid, "echo two > /root/f")
        pending = asyncio.create_task(c.checkpoint(sid, 2))
        base = run_dir / "env" / "checkpoints" / sid
        for _ in range(2000):  # wait until the checkpoint is in progress
            if any(p.name.startswith(".tmp-") for p in base.iterdir()):
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("checkpoint never started")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        pending.cancel()  # its answer will never come (waiting would take the client's 60 s)
        with contextlib.suppress(asyncio.CancelledError, BelayerError):
            await pending
        kv = await js.key_value(subjects.BUCKET_SANDBOX_PREFIX)
        ptr = msgspec.msgpack.decode((await kv.get(sid)).value, type=ReadyPointer)
        assert (ptr.prefix, ptr.checkpoint_id) == (1, first.checkpoint_id)

        proc2 = _spawn(nats_server.url, run_dir, node, tmp_path / "env2.log")
        await _wait_ready(c, proc2)
        assert not [p for p in base.iterdir() if p.name.startswith(".tmp-")]
        # the container was thawed: it answers
        assert (await c.exec(sid, "cat /root/f", timeout_s=10)).stdout.strip() == "two"
        r = await c.restore(sid)
        assert r.prefix == 1 and r.checkpoint_id == first.checkpoint_id
        assert (await c.exec(sid, "cat /root/f")).stdout.strip() == "one"
        await c.destroy(sid)
    finally:
        for p in (proc, proc2):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for cid in leftover_containers(docker_client, node):
            docker_client.api.remove_container(cid, force=True)


@pytest.mark.timeout(240)
async def test_a_restart_reaps_what_earlier_runs_of_the_run_dir_left(
    nc, nats_server, tmp_path
) -> None:
    """Run 1 (node label A) is SIGKILLed in the middle of a restore: the restore's fresh
    container has no record. Run 2 of the same run directory has another node label (a node
    gets a new one on every `belayer up`), yet reaps that container and the checkpoint
    directory of a sandbox that has no record, and keeps (adopts) the sandbox it knows."""
    docker_client = require_docker()
    run_dir = tmp_path / "run"
    nodes = ["run1-" + secrets.token_hex(4), "run2-" + secrets.token_hex(4)]
    c = EnvClient(nc, timeout=60)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_spawn(nats_server.url, run_dir, nodes[0], tmp_path / "env1.log"))
        await _wait_ready(c, procs[0])
        sid = (await c.create(limits=SandboxLimits(memory_mb=768))).sandbox_id
        await c.exec(
            sid,
            "head -c 200000000 /dev/urandom > /root/layer.bin; "
            'nohup python3 -c "import signal\nb=bytearray(256<<20)\n'
            'for i in range(0,len(b),4096): b[i]=1\nsignal.pause()" >/dev/null 2>&1 & sleep 2',
            timeout_s=60,
        )
        await c.checkpoint(sid, 1)
        (original,) = [s.container_id for s in (await c.list()).sandboxes]
        docker_client.api.kill(original)
        pending = asyncio.create_task(c.restore(sid))

        def fresh() -> list[str]:
            return [cid for cid in leftover_containers(docker_client, nodes[0]) if cid != original]

        for _ in range(3000):  # until the restore's fresh container exists (bounded)
            if fresh():
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the restore never created a container")
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        pending.cancel()  # its answer will never come
        with contextlib.suppress(asyncio.CancelledError, BelayerError):
            await pending
        interrupted = fresh()
        stray = run_dir / "env" / "checkpoints" / "sb-gone" / "sb-gone-k000001-abcdef"
        stray.mkdir(parents=True)  # a sandbox whose record is gone (its destroy was cut short)

        procs.append(_spawn(nats_server.url, run_dir, nodes[1], tmp_path / "env2.log"))
        await _wait_ready(c, procs[1])
        listing = (await c.list()).sandboxes
        assert [s.id for s in listing] == [sid]
        labelled = {cid for n in nodes for cid in leftover_containers(docker_client, n)}
        assert labelled <= {listing[0].container_id}, f"not reaped: {labelled} ({interrupted})"
        assert not stray.parent.exists()
        r = await c.restore(sid)
        assert r.prefix == 1
        assert (await c.exec(sid, "ls -s /root/layer.bin")).exit_code == 0
        await c.destroy(sid)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for n in nodes:
            for cid in leftover_containers(docker_client, n):
                docker_client.api.remove_container(cid, force=True)
