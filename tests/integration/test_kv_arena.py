"""The KV arena against a real nats-server: descriptors, zero-copy mapping shared with another
process, memory that survives the SIGKILL of a process that wrote it, flush, typed errors,
and no shared-memory file left after a stop."""

from __future__ import annotations

import asyncio
import signal
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import torch

from common import subjects
from common.codec import decode, encode
from common.config import parse_config
from common.epoch import claim_epoch
from common.errors import Conflict, NotFound
from model.config import load_model_config
from model.qwen3 import kv_cache_shape
from schemas.events import KvFlushed
from services.kv.client import fetch_arena, flush_arena, map_arena
from services.kv.config import KvArenaConfig
from services.kv.service import run
from tests.integration.shm_helpers import WAIT, running_service

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]


def running_arena(config: KvArenaConfig) -> AbstractAsyncContextManager[None]:
    """Run the service as a task; on exit stop it and check it removed its files."""
    return running_service(run, config, what="KV arena")


# Maps the arena, writes a pattern into one block, reports, then waits to be killed.
WRITER = r"""
import sys
from common.codec import decode
from schemas.weights import ArenaDesc
from services.kv.client import map_arena
arena = map_arena(decode(bytes.fromhex(sys.stdin.readline()), ArenaDesc))
arena[:, :, 3].fill_(7.0)
print("written", flush=True)
sys.stdin.readline()
"""


async def test_arena_shared_survives_writer_kill_and_flushes(
    nats_server, nc, js, model_dir, run_id
) -> None:
    config = KvArenaConfig(
        nats_url=nats_server.url,
        run_id=run_id,
        model_dir=model_dir,
        engine_ids=("e0", "e1"),
        num_blocks=8,
        block_size=4,
    )
    events: asyncio.Queue[KvFlushed] = asyncio.Queue()

    async def on_event(msg) -> None:
        await events.put(decode(msg.data, KvFlushed))

    await nc.subscribe(subjects.event(KvFlushed.kind), cb=on_event)
    async with running_arena(config):
        desc = await fetch_arena(nc, "e0")
        model = load_model_config(model_dir)
        assert tuple(desc.shape) == kv_cache_shape(model, 8, 4)
        assert desc.dtype == "float32" and desc.generation == 0
        assert desc.block_size == 4 and desc.num_blocks == 8
        arena = map_arena(desc)  # how fast: `belayer bench serve` measures a worker's attach
        assert arena.shape == torch.Size(desc.shape) and arena.dtype == torch.float32
        assert not arena.any()  # starts zero-filled

        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WRITER,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(encode(desc).hex().encode() + b"\n")
            assert await asyncio.wait_for(proc.stdout.readline(), WAIT) == b"written\n"
            # the child's writes land in the same memory we mapped
            assert bool((arena[:, :, 3] == 7.0).all()) and not arena[:, :, 4].any()
            proc.send_signal(signal.SIGKILL)
            assert await asyncio.wait_for(proc.wait(), WAIT) == -signal.SIGKILL
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        # the writer is dead; its KV is not
        again = map_arena(await fetch_arena(nc, "e0"))
        assert bool((again[:, :, 3] == 7.0).all())
        other = map_arena(await fetch_arena(nc, "e1"))
        assert not other.any()  # arenas are per engine

        # Only the epoch claimed in engine_epochs may flush: not one pushed out of reach, not
        # one nobody claimed yet.
        assert await claim_epoch(js, "e0") == 1
        for epoch in (10**12, 2):
            with pytest.raises(Conflict):
                await flush_arena(nc, "e0", epoch=epoch)
        assert bool((again[:, :, 3] == 7.0).all())  # refused flushes touched nothing
        assert await claim_epoch(js, "e0", expected=1) == 2
        flushed = await flush_arena(nc, "e0", epoch=2)
        assert flushed.generation == 1 and flushed.epoch == 2
        assert not arena.any() and not again.any()
        assert (await fetch_arena(nc, "e0")).generation == 1
        event = await asyncio.wait_for(events.get(), WAIT)
        assert event.engine_id == "e0" and event.generation == 1
        # a residual worker of an older epoch must not wipe the new worker's KV, and the
        # claimed epoch flushes once: a replay cannot wipe the KV its worker now writes
        arena[:, :, 1].fill_(3.0)
        for epoch in (1, 2):
            with pytest.raises(Conflict):
                await flush_arena(nc, "e0", epoch=epoch)
        assert bool((arena[:, :, 1] == 3.0).all())
        with pytest.raises(NotFound):
            await fetch_arena(nc, "nope")
        with pytest.raises(NotFound):
            await flush_arena(nc, "nope", epoch=0)


async def test_dtype_override_and_main_args(nats_server, nc, model_dir, run_id) -> None:
    config = parse_config(
        KvArenaConfig,
        [
            "--nats-url",
            nats_server.url,
            "--run-id",
            run_id,
            "--model-dir",
            str(model_dir),
            "--engine-ids",
            "e0, e1",
            "--num-blocks",
            "4",
            "--block-size",
            "2",
            "--dtype",
            "bfloat16",
        ],
    )
    assert config.engine_ids == ("e0", "e1") and config.num_blocks == 4
    async with running_arena(config):
        desc = await fetch_arena(nc, "e1")
        arena = map_arena(desc)
        assert arena.dtype == torch.bfloat16 and arena.shape[2:4] == (4, 2)
    with pytest.raises(SystemExit):
        parse_config(KvArenaConfig, ["--run-id", "r", "--engine-ids", "a.b"])
