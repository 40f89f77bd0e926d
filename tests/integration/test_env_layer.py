"""Layer-only checkpoints of quiescent sandboxes, on real dockerd + CRIU: a sandbox whose only
processes are its init is checkpointed as its writable layer alone and restored into a fresh
container with the same files and the same (init-only) processes; any runtime state beyond a
fresh container's — a process, a file in /dev, /dev/shm or /dev/mqueue, a System V object —
makes the checkpoint a CRIU dump again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.errors import CheckpointInvalid, SandboxError
from services.environment.client import EnvClient
from tests.integration.env_helpers import (
    BUMP,
    COUNTER,
    START_COUNTER,
    TREE_HASH,
    EnvHarness,
    env_kill,
    running_env,
    versioned_checkpoints,
)

pytestmark = [pytest.mark.docker]

PROCESSES = (
    'python3 -c "import os\n'
    "kids = {}\n"
    "for p in filter(str.isdigit, os.listdir('/proc')):\n"
    "  try:\n"
    "    stat = open(f'/proc/{p}/stat').read()\n"
    "    args = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\\\0', b' ').decode().strip()\n"
    "  except OSError:\n"
    "    continue\n"
    "  kids.setdefault(int(stat.rsplit(')', 1)[1].split()[1]), []).append((int(p), args))\n"
    "todo, out = [(1, open('/proc/1/cmdline', 'rb').read().replace(b'\\\\0', b' ').decode().strip())], []\n"
    "while todo:\n"
    "  pid, args = todo.pop()\n"
    "  out.append((pid, args))\n"
    "  todo += kids.get(pid, [])\n"
    "for pid, args in sorted(out):\n"
    '  print(pid, args)"'
)
"""The processes the sandbox runs: its init (pid 1) and init's descendants, by pid. An exec's
own processes (this listing's shell and python) hang off no sandbox process (``docker exec``
starts them with parent 0), so they are never listed."""

SYSV = 'python3 -c "import ctypes; assert ctypes.CDLL(None).shmget(4321, 4096, 0o1666) >= 0"'
MQUEUE = (
    'python3 -c "import ctypes, os; '
    "assert ctypes.CDLL('librt.so.1').mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0\""
)


@pytest.fixture
async def layer_env(nc, js, nats_server, tmp_path: Path) -> AsyncIterator[EnvHarness]:
    """The environment service with the product default: quiescent sandboxes checkpoint as
    their layer alone."""
    async with running_env(
        nc, nats_server.url, tmp_path, layer_only_when_quiescent=True
    ) as harness:
        yield harness


async def _processes(c: EnvClient, sid: str) -> list[str]:
    out = (await c.exec(sid, PROCESSES)).stdout
    return [" ".join(line.split()[1:]) for line in out.splitlines() if line.strip()]


@pytest.mark.timeout(180)
async def test_a_quiescent_sandbox_checkpoints_as_its_layer_and_restores_exactly(
    layer_env: EnvHarness,
) -> None:
    c = layer_env.client
    sid = (await c.create(files={"/root/counter.py": COUNTER})).sandbox_id
    setup = "echo one > /root/a && mkdir -p /root/d && echo two > /root/d/b && rm -f /etc/motd"
    assert (await c.exec(sid, setup)).exit_code == 0
    before = await _processes(c, sid)
    hash_k = (await c.exec(sid, TREE_HASH)).stdout.strip()

    info = await c.checkpoint(sid, 1)
    assert info.method == "layer" and info.criu_bytes == 0
    assert set(info.digests) == {"fs.tar"}
    ck_dir = layer_env.config.checkpoint_root / sid / info.checkpoint_id
    assert not any((ck_dir / "criu").iterdir())

    assert (
        await c.exec(sid, "echo later > /root/a && rm /root/d/b && touch /root/new")
    ).exit_code == 0
    await env_kill(layer_env, sid)
    restored = await c.restore(sid)
    assert restored.method == "layer" and restored.checkpoint_id == info.checkpoint_id
    assert (await c.exec(sid, TREE_HASH)).stdout.strip() == hash_k
    assert (await c.exec(sid, "cat /root/a /root/d/b")).stdout.split() == ["one", "two"]
    assert await _processes(c, sid) == before  # init and its sleep, as at the checkpoint

    # a process the agent leaves running is runtime state: CRIU dumps it, and it comes back
    assert (await c.exec(sid, START_COUNTER)).exit_code == 0
    assert (await c.exec(sid, BUMP)).stdout.strip() == "1"
    with_process = await c.checkpoint(sid, 2)
    assert with_process.method == "runc" and with_process.criu_bytes > 0
    await env_kill(layer_env, sid)
    again = await c.restore(sid)
    assert again.method == "runtime" and again.prefix == 2
    assert (await c.exec(sid, BUMP)).stdout.strip() == "2"  # its memory came back too


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("state", "check"),
    [
        ("echo x > /dev/shm/x", "cat /dev/shm/x"),
        ("touch /dev/extra", "ls /dev/extra"),
        ("rm /dev/full", "! ls /dev/full"),
        (SYSV, "grep -c 4321 /proc/sysvipc/shm"),
    ],
    ids=["dev-shm", "dev-file", "dev-removed", "sysv-shm"],
)
async def test_state_beyond_a_fresh_container_gets_a_criu_dump(
    layer_env: EnvHarness, state: str, check: str
) -> None:
    """No process survives the action, yet the sandbox holds state a fresh container lacks:
    the checkpoint must be a CRIU dump, and a restore brings the state back."""
    c = layer_env.client
    sid = (await c.create()).sandbox_id
    quiet = await c.checkpoint(sid, 1)
    assert quiet.method == "layer"
    result = await c.exec(sid, state)
    assert result.exit_code == 0, result.stderr
    info = await c.checkpoint(sid, 2)
    assert info.method == "runc" and info.criu_bytes > 0
    await env_kill(layer_env, sid)
    restored = await c.restore(sid)
    assert restored.prefix == 2 and restored.method != "layer"
    assert (await c.exec(sid, check)).exit_code == 0


@pytest.mark.timeout(120)
async def test_a_message_queue_is_not_dropped_by_a_layer_checkpoint(layer_env: EnvHarness) -> None:
    """CRIU cannot dump a POSIX message queue; a sandbox holding one is not quiescent, so its
    checkpoint is a (failing) CRIU dump, never a layer that silently drops the queue."""
    c = layer_env.client
    sid = (await c.create()).sandbox_id
    first = await c.checkpoint(sid, 1)
    assert (await c.exec(sid, MQUEUE)).exit_code == 0
    with pytest.raises(SandboxError, match="criu dump"):
        await c.checkpoint(sid, 2)
    listing = {s.id: s for s in (await c.list()).sandboxes}
    assert listing[sid].checkpoint_id == first.checkpoint_id  # the ready one stays


@pytest.mark.timeout(180)
async def test_a_layer_checkpoint_with_planted_process_images_is_refused(
    layer_env: EnvHarness,
) -> None:
    """Process images slipped into a layer-only checkpoint (its manifest lists none) are
    refused on restore; the previous ready checkpoint is used."""
    c = layer_env.client
    sid = (await c.create()).sandbox_id
    first, second = await versioned_checkpoints(c, sid, 2)
    assert first.method == second.method == "layer"
    planted = layer_env.config.checkpoint_root / sid / second.checkpoint_id / "criu" / "core-1.img"
    planted.write_bytes(b"not a process")
    with pytest.raises(CheckpointInvalid, match="holds process images"):
        await c.restore(sid, second.checkpoint_id)
    await env_kill(layer_env, sid)
    restored = await c.restore(sid)
    assert restored.checkpoint_id == first.checkpoint_id
    assert (await c.exec(sid, "cat /root/v")).stdout.strip() == "v1"
