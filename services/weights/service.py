"""The weight store on the bus: ``weights.get`` and ``weights.push``.

The ``weight_version`` KV bucket's key ``current`` holds the **encoded WeightManifest** of the
current version (MessagePack, ``WeightManifest.v1``), so a reader can learn the current
version (or watch for new ones) without a request; it is advanced with compare-and-set on
every push. A ``weights_updated`` event follows each push.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats.js.errors
from nats.js.kv import KeyValue

from common import events, subjects
from common.codec import decode, encode
from common.errors import Conflict, InvalidRequest
from common.service import Service, run_service
from schemas.events import WeightsUpdated
from schemas.weights import WeightManifest, WeightsGet, WeightsPush
from services.weights.client import CURRENT_KEY
from services.weights.config import WeightStoreConfig
from services.weights.objects import Exporter
from services.weights.store import WeightStore

SERVICE = "weights"


class WeightsService(Service[WeightStoreConfig]):
    """Loads the model into shared memory as the first (or next) version, serves ``weights.get``
    and ``weights.push``; on stop unlinks every version's file."""

    name = SERVICE

    def __init__(self, config: WeightStoreConfig) -> None:
        super().__init__(config)
        self.log = self.log.bind(run_id=config.run_id)
        self.store = WeightStore(
            config.run_id, config.model_dir, config.keep_versions, config.first_version
        )

    async def setup(self) -> None:
        kv = await self.js.key_value(subjects.BUCKET_WEIGHT_VERSION)
        prior, revision = await _read_pointer(kv, self.log)
        manifest = await asyncio.to_thread(self.store.start, prior)
        pointer = _Pointer(kv, revision)
        handlers = _Handlers(self.config, self.store, pointer, self.js, self.log)
        await self.server.serve(subjects.weights_get(), WeightsGet, handlers.get)
        await self.server.serve(subjects.weights_push(), WeightsPush, handlers.push)
        exporter = Exporter(self.js, self.store, self.config.bus.replicas, self.log)
        await self.server.serve(subjects.weights_export(), WeightsGet, exporter.export)
        # Publish the pointer only once weights.get answers: whoever sees it can fetch it.
        await pointer.advance(manifest)
        self.log.info("weights_loaded", version=manifest.version)

    async def close(self) -> None:
        removed = self.store.close()
        self.log.info("shm_removed", files=len(removed))


async def run(
    config: WeightStoreConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Serve the weight store until ``stop`` (see ``WeightsService``; with ``config.host``,
    an engine host's mirror, ``MirrorService``)."""
    if config.host:
        from services.weights.mirror import MirrorService

        await run_service(MirrorService(config), stop=stop, ready=ready)
        return
    await run_service(WeightsService(config), stop=stop, ready=ready)


async def _read_pointer(kv: KeyValue, log: Any) -> tuple[WeightManifest | None, int | None]:
    """The manifest ``current`` points at and its revision (None, None when unset)."""
    try:
        entry = await kv.get(CURRENT_KEY)
    except nats.js.errors.KeyNotFoundError:
        return None, None
    try:
        return decode(entry.value or b"", WeightManifest), entry.revision
    except InvalidRequest:
        log.warning("pointer_unreadable", revision=entry.revision)
        return None, entry.revision


class _Pointer:
    """The ``current`` key, advanced only by compare-and-set on the revision we last wrote."""

    def __init__(self, kv: KeyValue, revision: int | None) -> None:
        self.kv = kv
        self.revision = revision

    async def advance(self, manifest: WeightManifest) -> None:
        value = encode(manifest)
        try:
            if self.revision is None:
                self.revision = await self.kv.create(CURRENT_KEY, value)
            else:
                self.revision = await self.kv.update(CURRENT_KEY, value, last=self.revision)
        except nats.js.errors.KeyValueError as exc:
            # Someone else moved the pointer: another store on this bus. Never overwrite it.
            raise Conflict(
                "weight_version pointer moved under this store",
                version=manifest.version,
                error=repr(exc),
            ) from None


class _Handlers:
    """Request handlers; pushes are serialised by a lock, reads never wait for them."""

    def __init__(
        self, config: WeightStoreConfig, store: WeightStore, pointer: _Pointer, js: Any, log: Any
    ) -> None:
        self.log = log
        self.config = config
        self.store = store
        self.pointer = pointer
        self.js = js
        self.lock = asyncio.Lock()

    async def get(self, req: WeightsGet, _msg: Any) -> WeightManifest:
        return self.store.get(req.version)

    async def push(self, req: WeightsPush, _msg: Any) -> WeightManifest:
        async with self.lock:
            t0 = time.perf_counter()
            # Copy + checksum in a thread: gets keep being answered meanwhile.
            version = await asyncio.to_thread(self.store.ingest, req)
            manifest = version.manifest
            try:
                await self.pointer.advance(manifest)
            except BaseException:
                self.store.discard(version)
                raise
            collected = self.store.publish(version)
            seconds = round(time.perf_counter() - t0, 4)
        self.log.info(
            "weights_pushed",
            version=manifest.version,
            base_version=req.base_version,
            bytes=manifest.handle.size,
            seconds=seconds,
            collected=collected,
        )
        event = WeightsUpdated(
            version=manifest.version,
            base_version=req.base_version,
            checksum=manifest.checksum,
            bytes=manifest.handle.size,
            seconds=seconds,
        )
        msg_id = f"weights_updated-{self.config.run_id}-{manifest.version}"
        await events.publish(self.js, event, msg_id=msg_id)
        return manifest
