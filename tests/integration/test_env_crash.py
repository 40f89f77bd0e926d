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
from tests.integration.env_helpers import leftover_containers, require_docker

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
) -> None:  # type: ignore[no-untyped-def]
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
            'echo one > /root/f; nohup python3 -c "import signal\n'
            "b=bytearray(384<<20)\nfor i in range(0,len(b),4096): b[i]=1\n"
            'signal.pause()" >/dev/null 2>&1 & sleep 2.5',
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
        with contextlib.suppress(BelayerError):
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
