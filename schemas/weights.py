"""Messages of the weight store and the KV arena: descriptors, never tensors inline."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.base import Message
from schemas.serving import EngineId


class MemoryHandle(msgspec.Struct, kw_only=True):
    """Where shared memory lives. CPU: a file under /dev/shm mapped with ``torch.from_file``.
    GPU: a CUDA IPC handle (``kind == "cuda_ipc"``, ``ipc`` holds the serialized handle)."""

    kind: Literal["shm", "cuda_ipc"] = "shm"
    path: str = ""
    size: int = 0
    ipc: bytes = b""


class TensorDesc(msgspec.Struct, kw_only=True):
    """One tensor inside a handle's memory: bytes ``[offset, offset+nbytes)``."""

    name: str
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``float32``."""
    shape: list[int]
    offset: int
    nbytes: int


class WeightsGet(Message, tag="WeightsGet.v1"):
    """Request the manifest of ``version`` (default: the current one)."""

    version: int | None = None


class WeightManifest(Message, tag="WeightManifest.v1"):
    """One immutable weight version. Readers map the whole handle: a version never changes
    after it is published, so nobody reads a torn mix of two versions."""

    version: int
    handle: MemoryHandle
    tensors: list[TensorDesc]
    checksum: str
    """sha256 of the handle's bytes."""
    model_dir: str
    """The Hugging Face style directory whose config.json describes the architecture."""
    created_at: float = 0.0


class WeightsPush(Message, tag="WeightsPush.v1"):
    """Trainer → weight store: adopt new weights. The pusher wrote them into ``handle`` (same
    layout as ``tensors``); the store validates names/shapes/checksum against the current
    version, copies them into a fresh version and replies with its ``WeightManifest``."""

    handle: MemoryHandle
    tensors: list[TensorDesc]
    checksum: str
    base_version: int
    """The version these weights were trained from (compare-and-set: stale pushes fail)."""


class KvGet(Message, tag="KvGet.v1"):
    """Request the KV arena descriptor of one engine."""

    engine_id: EngineId


class ArenaDesc(Message, tag="ArenaDesc.v1"):
    """An engine's paged KV block pool: ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""

    engine_id: EngineId
    handle: MemoryHandle
    shape: list[int]
    dtype: str
    block_size: int
    num_blocks: int
    generation: int
    """Bumped by every flush."""
    epoch: int = 0
    """Engine epoch of the last accepted flush (0 before any); a flush under it again or under
    an epoch other than the claimed one is refused."""


class KvFlush(Message, tag="KvFlush.v1"):
    """Zero an engine's arena before a new worker uses it: sent by the worker that just claimed
    ``epoch`` (a main worker at start, a shadow at handover step 3). Refused (``conflict``)
    unless ``epoch`` is the one ``engine_epochs`` holds and the arena was not flushed under it
    yet."""

    engine_id: EngineId
    epoch: int = 0
    """The epoch the sender just claimed by compare-and-set."""
