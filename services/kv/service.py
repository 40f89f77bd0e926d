"""The KV arena on the bus: ``kv.get`` hands out an engine's arena descriptor, ``kv.flush``
zeroes it — only under the epoch claimed in ``engine_epochs``, once per epoch, by the worker
that just claimed it (handover step 3, or a main worker's start) — and publishes a
``kv_flushed`` event."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common import events, subjects
from common.dtypes import itemsize
from common.epoch import current_epoch
from common.service import Service, run_service
from model.config import kv_cache_shape, load_model_config
from schemas.events import KvFlushed
from schemas.weights import ArenaDesc, KvFlush, KvGet
from services.kv.arena import ArenaPool
from services.kv.config import KvArenaConfig

SERVICE = "kv"


class KvService(Service[KvArenaConfig]):
    """Allocates every engine's arena before connecting, serves ``kv.get``/``kv.flush``; on
    stop unlinks the arena files."""

    name = SERVICE

    def __init__(self, config: KvArenaConfig) -> None:
        super().__init__(config)
        self.log = self.log.bind(run_id=config.run_id)
        self.pool = ArenaPool(config.run_id)

    async def open(self) -> None:
        config = self.config
        model = load_model_config(config.model_dir)
        dtype = config.dtype or model.torch_dtype
        itemsize(dtype)  # an unknown dtype is refused before anything is allocated
        shape = kv_cache_shape(model, config.num_blocks, config.block_size)
        for engine_id in config.engine_ids:
            self.pool.allocate(engine_id, shape, dtype, config.block_size)
        for path in self.pool.remove_strays():
            self.log.info("stale_arena_removed", path=path)
        self.log.info("arenas_allocated", engines=list(config.engine_ids))

    async def setup(self) -> None:
        for arena in self.pool.arenas.values():
            if arena.adopted:
                # Restarted under live workers: their epoch's flush already happened.
                arena.epoch, _ = await current_epoch(self.js, arena.engine_id)
                self.log.info("arena_epoch_adopted", engine_id=arena.engine_id, epoch=arena.epoch)
        handlers = _Handlers(self.config, self.pool, self.js, self.log)
        host = self.config.host
        await self.server.serve(subjects.kv_get(host), KvGet, handlers.get)
        await self.server.serve(subjects.kv_flush(host), KvFlush, handlers.flush)

    async def close(self) -> None:
        removed = self.pool.close()
        self.log.info("shm_removed", files=len(removed))


async def run(
    config: KvArenaConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Serve the KV arena until ``stop`` (see ``KvService``)."""
    await run_service(KvService(config), stop=stop, ready=ready)


class _Handlers:
    def __init__(self, config: KvArenaConfig, pool: ArenaPool, js: Any, log: Any) -> None:
        self.config = config
        self.pool = pool
        self.js = js
        self.log = log

    async def get(self, req: KvGet, _msg: Any) -> ArenaDesc:
        return self.pool.get(req.engine_id).desc()

    async def flush(self, req: KvFlush, _msg: Any) -> ArenaDesc:
        self.pool.get(req.engine_id)  # NotFound before anything else
        claimed, _ = await current_epoch(self.js, req.engine_id)
        t0 = time.perf_counter()
        # Zeroing a large arena takes a while: keep kv.get answering meanwhile. (Flushes are
        # served one at a time, so the epoch check and the flush cannot interleave.)
        arena = await asyncio.to_thread(self.pool.flush, req.engine_id, req.epoch, claimed)
        ms = round((time.perf_counter() - t0) * 1000, 3)
        self.log.info(
            "kv_flushed",
            engine_id=req.engine_id,
            epoch=req.epoch,
            generation=arena.generation,
            ms=ms,
        )
        event = KvFlushed(
            engine_id=req.engine_id, generation=arena.generation, epoch=req.epoch, ms=ms
        )
        msg_id = f"kv_flushed-{self.config.run_id}-{req.engine_id}-{arena.generation}"
        await events.publish(self.js, event, msg_id=msg_id)
        return arena.desc()
