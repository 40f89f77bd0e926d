"""The KV arena on the bus: ``kv.get`` hands out an engine's arena descriptor, ``kv.flush``
zeroes it (handover step 3) and publishes a ``kv_flushed`` event."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats.errors

from common import subjects
from common.bus import Server, connect, ensure_jetstream, publish_event
from common.logging import get_logger
from common.service import Status
from common.tensors import parse_dtype
from model.config import load_model_config
from model.qwen3 import kv_cache_shape
from schemas.events import Event
from schemas.weights import ArenaDesc, KvFlush, KvGet
from services.kv.arena import ArenaPool
from services.kv.config import KvArenaConfig

SERVICE = "kv"


async def run(
    config: KvArenaConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Allocate every engine's arena, serve until ``stop`` is set, then unlink the files."""
    log = get_logger(service=SERVICE, run_id=config.run_id)
    log.info("service_status", status=Status.STARTING.value, engines=list(config.engine_ids))
    model = load_model_config(config.model_dir)
    dtype = parse_dtype(config.dtype) if config.dtype else model.dtype
    shape = kv_cache_shape(model, config.num_blocks, config.block_size)
    pool = ArenaPool(config.run_id)
    try:
        for engine_id in config.engine_ids:
            pool.allocate(engine_id, shape, dtype, config.block_size)
        for path in pool.remove_strays():
            log.info("stale_arena_removed", path=path)
        nc = await connect(config.nats_url, name=SERVICE)
    except BaseException:
        pool.close()
        raise
    server = Server(nc, service=SERVICE)
    try:
        js = nc.jetstream()
        await ensure_jetstream(js)
        handlers = _Handlers(config, pool, js, log)
        await server.serve(subjects.kv_get(), KvGet, handlers.get)
        await server.serve(subjects.kv_flush(), KvFlush, handlers.flush)
        await nc.flush()  # subscriptions reach the server before anyone hears "ready"
        log.info("service_status", status=Status.READY.value)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("service_status", status=Status.DRAINING.value)
        await server.drain()
    finally:
        removed = pool.close()
        log.info("shm_removed", files=len(removed))
        try:
            await nc.drain()
        except nats.errors.Error:
            pass
        log.info("service_status", status=Status.STOPPED.value)


class _Handlers:
    def __init__(self, config: KvArenaConfig, pool: ArenaPool, js: Any, log: Any) -> None:
        self.config = config
        self.pool = pool
        self.js = js
        self.log = log

    async def get(self, req: KvGet, _msg: Any) -> ArenaDesc:
        return self.pool.get(req.engine_id).desc()

    async def flush(self, req: KvFlush, _msg: Any) -> ArenaDesc:
        t0 = time.perf_counter()
        # Zeroing a large arena takes a while: keep kv.get answering meanwhile.
        arena = await asyncio.to_thread(self.pool.flush, req.engine_id, req.epoch)
        ms = round((time.perf_counter() - t0) * 1000, 3)
        self.log.info(
            "kv_flushed",
            engine_id=req.engine_id,
            epoch=req.epoch,
            generation=arena.generation,
            ms=ms,
        )
        event = Event(
            kind="kv_flushed",
            ts=time.time(),
            source=SERVICE,
            engine_id=req.engine_id,
            data={"generation": arena.generation, "epoch": req.epoch, "ms": ms},
        )
        msg_id = f"kv_flushed-{self.config.run_id}-{req.engine_id}-{arena.generation}"
        await publish_event(self.js, event, msg_id=msg_id)
        return arena.desc()
