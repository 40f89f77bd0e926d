"""What a rollout worker (or its shadow) calls: fetch its arena, map it, flush it."""

from __future__ import annotations

import torch
from nats.aio.client import Client as NATS

from common import shm, subjects
from common.bus import request
from common.errors import InvalidRequest
from common.tensors import parse_dtype
from schemas.weights import ArenaDesc, KvFlush, KvGet


async def fetch_arena(nc: NATS, engine_id: str, timeout: float = 5.0) -> ArenaDesc:
    """The arena descriptor of ``engine_id``; ``NotFound`` for an unknown engine."""
    reply: ArenaDesc = await request(
        nc, subjects.kv_get(), KvGet(engine_id=engine_id), ArenaDesc, timeout=timeout
    )
    return reply


def map_arena(desc: ArenaDesc) -> torch.Tensor:
    """The arena as a tensor of ``desc.shape`` and ``desc.dtype``, zero copy: writes are
    seen by every process that maps it, and survive the writer's death."""
    buf = shm.attach(desc.handle)
    dtype = parse_dtype(desc.dtype)
    if buf.numel() % dtype.itemsize:
        raise InvalidRequest("arena size is not a whole number of elements", dtype=desc.dtype)
    return buf.view(dtype).view(desc.shape)


async def flush_arena(nc: NATS, engine_id: str, epoch: int, timeout: float = 2.0) -> ArenaDesc:
    """Zero the engine's arena before a new worker uses it; returns the descriptor with the
    bumped ``generation``. ``Conflict`` when a newer epoch already flushed it."""
    reply: ArenaDesc = await request(
        nc,
        subjects.kv_flush(),
        KvFlush(engine_id=engine_id, epoch=epoch),
        ArenaDesc,
        timeout=timeout,
    )
    return reply
