"""What readers and the trainer call: fetch a manifest, map a version, push new weights.

Readers map one manifest's memory: every tensor they get comes from that one immutable
version, never a mix. A version older than the store's ``keep_versions`` may be collected
between fetching its manifest and mapping it; :func:`map_weights` then raises ``NotFound``
and the reader fetches the current manifest again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common import subjects
from common.bus import request
from common.codec import decode
from common.config import shm_path
from common.errors import BelayerError
from schemas.weights import WeightManifest, WeightsGet, WeightsPush
from services.weights.config import WeightStoreConfig

if TYPE_CHECKING:
    import torch

    from services.weights import core

# torch and what is built on it (``common.shm``, ``core``) are imported where memory is mapped
# or written, so the supervisor and the CLI can import this module for ``WeightStoreConfig``.
__all__ = [
    "CURRENT_KEY",
    "WeightStoreConfig",
    "current_manifest",
    "fetch_manifest",
    "map_weights",
    "push_weights",
]

CURRENT_KEY = "current"
"""Key in the ``weight_version`` bucket; its value is the encoded current ``WeightManifest``."""

PUSH_FILE_PREFIX = "wpush-"
"""Name of a pusher's temporary shm file after the run prefix."""


async def fetch_manifest(
    nc: NATS,
    version: int | None = None,
    timeout: float = 5.0,
    *,
    host: str = "",
    restart_wait_s: float = 0.0,
) -> WeightManifest:
    """The manifest of ``version`` (default: the current one) from the node's store, or with
    ``host`` from that engine host's mirror. Raises ``NotFound`` for a version the store does
    not keep, ``BusUnavailable`` when no store answers (after ``restart_wait_s`` of asking a
    store that is restarting)."""
    subject = subjects.weights_get(host)
    reply: WeightManifest = await request(
        nc,
        subject,
        WeightsGet(version=version),
        WeightManifest,
        timeout=timeout,
        responder_wait_s=restart_wait_s,
    )
    return reply


async def current_manifest(js: JetStreamContext) -> WeightManifest | None:
    """The manifest the weight store itself marks current (KV ``weight_version``, key
    ``current``, advanced only by the store's compare-and-set); None when unset or unreadable.
    A ``weights_updated`` event is only a hint to look here."""
    try:
        kv = await js.key_value(subjects.BUCKET_WEIGHT_VERSION)
        entry = await kv.get(CURRENT_KEY)
    except (nats.errors.Error, TimeoutError):  # no bucket or key yet, JetStream unavailable
        return None
    try:
        return decode(entry.value or b"", WeightManifest)
    except BelayerError:
        return None


def map_weights(manifest: WeightManifest) -> dict[str, torch.Tensor]:
    """Zero-copy views of every tensor of one version, by Hugging Face name.

    The views share the store's memory: never write to them. Raises ``NotFound`` when the
    version's memory was already collected."""
    from common import shm

    return shm.map_tensors(manifest.handle, manifest.tensors)


async def push_weights(
    nc: NATS,
    state_dict: Mapping[str, torch.Tensor],
    base_version: int,
    run_id: str,
    timeout: float = 60.0,
) -> WeightManifest:
    """Publish ``state_dict`` as the version after ``base_version``; returns its manifest.

    The tensors are packed into a temporary shm file (removed once the store replied); the
    store copies them into its own new version. Raises ``Conflict`` if another push won
    since ``base_version``, ``InvalidRequest`` if names, dtypes or shapes differ from the
    current version.
    """
    from common import shm
    from common.tensors import dtype_name
    from services.weights import core

    layout = core.plan_layout({k: (dtype_name(t.dtype), t.shape) for k, t in state_dict.items()})
    path = shm_path(run_id, f"{PUSH_FILE_PREFIX}{uuid.uuid4().hex[:12]}")
    try:
        digest = await asyncio.to_thread(_write, path, layout, state_dict)
        push = WeightsPush(
            handle=shm.shm_handle(path, layout.size),
            tensors=layout.tensors,
            checksum=digest,
            base_version=base_version,
        )
        reply: WeightManifest = await request(
            nc, subjects.weights_push(), push, WeightManifest, timeout=timeout
        )
        return reply
    finally:
        shm.unlink(path)


def _write(path: Path, layout: core.Layout, state_dict: Mapping[str, torch.Tensor]) -> str:
    """The tensors copied into a new shm file at their places in ``layout``; its checksum."""
    import torch

    from common import shm
    from common.tensors import view_tensor
    from services.weights import core

    buf = shm.create(path, layout.size)
    with torch.no_grad():
        for desc in layout.tensors:
            view_tensor(buf, desc).copy_(state_dict[desc.name])
    return core.checksum(buf.numpy().data)
