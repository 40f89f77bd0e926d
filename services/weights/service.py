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

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from common import subjects
from common.bus import Server, connect, ensure_jetstream, publish_event
from common.codec import decode, encode
from common.errors import Conflict, InvalidRequest
from common.logging import get_logger
from common.service import Status
from schemas.events import Event
from schemas.weights import WeightManifest, WeightsGet, WeightsPush
from services.weights.config import WeightStoreConfig
from services.weights.store import WeightStore

SERVICE = "weights"
CURRENT_KEY = "current"
"""Key in the ``weight_version`` bucket; its value is the encoded current ``WeightManifest``."""


async def run(
    config: WeightStoreConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Load the model into shared memory, serve until ``stop`` is set, then unlink every
    version's file and drain the connection."""
    log = get_logger(service=SERVICE, run_id=config.run_id)
    status = Status.STARTING
    log.info("service_status", status=status.value, run_id=config.run_id)
    store = WeightStore(config.run_id, config.model_dir, config.keep_versions)
    nc = await connect(config.nats_url, name=SERVICE)
    server = Server(nc, service=SERVICE)
    try:
        js = nc.jetstream()
        await ensure_jetstream(js)
        kv = await js.key_value(subjects.BUCKET_WEIGHT_VERSION)
        prior, revision = await _read_pointer(kv, log)
        manifest = await asyncio.to_thread(store.start, prior)
        pointer = _Pointer(kv, revision)
        handlers = _Handlers(config, store, pointer, js, log)
        await server.serve(subjects.weights_get(), WeightsGet, handlers.get)
        await server.serve(subjects.weights_push(), WeightsPush, handlers.push)
        await nc.flush()  # subscriptions reach the server before anyone hears "ready"
        # Publish the pointer only once weights.get answers: whoever sees it can fetch it.
        await pointer.advance(manifest)
        status = Status.READY
        log.info("service_status", status=status.value, version=manifest.version)
        if ready is not None:
            ready.set()
        await stop.wait()
        status = Status.DRAINING
        log.info("service_status", status=status.value)
        await server.drain()
    finally:
        removed = store.close()
        log.info("shm_removed", files=len(removed))
        try:
            await nc.drain()
        except nats.errors.Error:
            pass
        log.info("service_status", status=Status.STOPPED.value)


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
        event = Event(
            kind="weights_updated",
            ts=time.time(),
            source=SERVICE,
            data={
                "version": manifest.version,
                "base_version": req.base_version,
                "checksum": manifest.checksum,
                "bytes": manifest.handle.size,
                "seconds": seconds,
            },
        )
        msg_id = f"weights_updated-{self.config.run_id}-{manifest.version}"
        await publish_event(self.js, event, msg_id=msg_id)
        return manifest
