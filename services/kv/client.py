"""What a rollout worker (or its shadow) calls: fetch its arena, map it, flush it; and the
service's config (the supervisor starts the arena from it). torch is imported where memory is
mapped, so importing this module for the config stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS

from common import subjects
from common.bus import request
from common.errors import InvalidRequest
from schemas.weights import ArenaDesc, KvFlush, KvGet
from services.kv.config import KvArenaConfig

if TYPE_CHECKING:
    import torch

__all__ = ["KvArenaConfig", "fetch_arena", "flush_arena", "map_arena"]


async def fetch_arena(
    nc: NATS, engine_id: str, timeout: float = 5.0, *, host: str = "", restart_wait_s: float = 0.0
) -> ArenaDesc:
    """The arena descriptor of ``engine_id`` (``host``: from that engine host's arena
    service); ``NotFound`` for an unknown engine. ``restart_wait_s``: how long to keep asking
    an arena service that is restarting (no responder) before ``BusUnavailable``."""
    reply: ArenaDesc = await request(
        nc,
        subjects.kv_get(host),
        KvGet(engine_id=engine_id),
        ArenaDesc,
        timeout=timeout,
        responder_wait_s=restart_wait_s,
    )
    return reply


def map_arena(desc: ArenaDesc) -> torch.Tensor:
    """The arena as a tensor of ``desc.shape`` and ``desc.dtype``, zero copy: writes are
    seen by every process that maps it, and survive the writer's death."""
    from common import shm
    from common.tensors import parse_dtype

    buf = shm.attach(desc.handle)
    dtype = parse_dtype(desc.dtype)
    if buf.numel() % dtype.itemsize:
        raise InvalidRequest("arena size is not a whole number of elements", dtype=desc.dtype)
    return buf.view(dtype).view(desc.shape)


async def flush_arena(
    nc: NATS, engine_id: str, epoch: int, timeout: float = 2.0, *, host: str = ""
) -> ArenaDesc:
    """Zero the engine's arena before a new worker uses it; returns the descriptor with the
    bumped ``generation``. ``Conflict`` when a newer epoch already flushed it."""
    reply: ArenaDesc = await request(
        nc,
        subjects.kv_flush(host),
        KvFlush(engine_id=engine_id, epoch=epoch),
        ArenaDesc,
        timeout=timeout,
    )
    return reply
