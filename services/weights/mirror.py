"""An engine host's weight store: a local mirror of the node's versions.

On a host other than the node's, the rollout workers cannot map the node's shared memory. This
store serves them the same way the node's does (``weights.get``, on the host's own subject
``belayer.host.<host>.weights.get``), from its own shared memory, filled over the bus: it asks
the node's store to export a version (``weights.export``), reads the object from the
``weight_objects`` Object Store straight into a new shm file, checks the version's checksum,
and publishes it locally. It follows the node: on each ``weights_updated`` hint it reads the
node's current version (KV ``weight_version``) and mirrors it; a worker asking for a version
not mirrored yet waits for its mirroring. The model's ``config.json`` is mirrored into the
store's ``model_dir`` with the tokenizer's files (the engines and the host's KV arena read
them there).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg

from common import events, shm, subjects
from common.bus import request
from common.codec import decode
from common.errors import BelayerError, InvalidRequest
from common.guard import isolated
from common.service import Service
from common.tasks import keep
from schemas.events import WeightsUpdated
from schemas.weights import WeightManifest, WeightsGet
from services.weights import core
from services.weights.client import current_manifest
from services.weights.config import WeightStoreConfig
from services.weights.objects import open_bucket, read_into, read_model_files
from services.weights.store import Version, WeightStore

EXPORT_TIMEOUT_S = 120.0
"""How long the node's store may take to put a version into the Object Store."""


class MirrorService(Service[WeightStoreConfig]):
    """The weight store of an engine host (``config.host``): mirrors, then serves locally."""

    name = "weights"

    def __init__(self, config: WeightStoreConfig) -> None:
        super().__init__(config)
        self.log = self.log.bind(run_id=config.run_id, host=config.host)
        self.store = WeightStore(config.run_id, config.model_dir, config.keep_versions)
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.model_files: list[str] = []

    async def setup(self) -> None:
        manifest = await self.mirror(None)
        await self.server.serve(subjects.weights_get(self.config.host), WeightsGet, self.get)
        await self.nc.subscribe(events.subject(WeightsUpdated), cb=self._on_update)
        self.log.info("weights_mirrored_ready", version=manifest.version)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        removed = self.store.close()
        self.log.info("shm_removed", files=len(removed))

    async def get(self, req: WeightsGet, _msg: Any) -> WeightManifest:
        """A version this host holds; a newer one is mirrored first (the workers follow the
        node's current version and ask for it by number)."""
        if req.version is None or req.version in self.store.versions:
            return self.store.get(req.version)
        if req.version < self.store.current:
            return self.store.get(req.version)  # older than kept: NotFound
        return await self.mirror(req.version)

    async def _on_update(self, msg: Msg) -> None:
        """A hint: mirror the version the node marks current, in the background."""
        try:
            decode(msg.data, WeightsUpdated)
        except BelayerError:
            return

        async def follow() -> None:
            with isolated(self.log, "mirror_follow"):
                current = await current_manifest(self.js)
                if current is not None and current.version > self.store.current:
                    await self.mirror(current.version)

        keep(self.tasks, asyncio.create_task(follow(), name="mirror_follow"))

    async def mirror(self, version: int | None) -> WeightManifest:
        """Mirror ``version`` (None: the node's current) unless held; its local manifest."""
        async with self.lock:
            if version is not None and version in self.store.versions:
                return self.store.get(version)
            t0 = time.perf_counter()
            remote: WeightManifest = await request(
                self.nc,
                subjects.weights_export(),
                WeightsGet(version=version),
                WeightManifest,
                timeout=EXPORT_TIMEOUT_S,
            )
            if remote.version in self.store.versions:
                return self.store.get(remote.version)
            obs = await open_bucket(self.js)
            if not self.model_files:  # once per start: the node may run another model now
                self.model_files = await read_model_files(obs, Path(self.config.model_dir))
            local = await self._fetch(obs, remote)
            if remote.version > self.store.current:
                self.store.publish(local)
            else:
                self.store.versions[remote.version] = local
            self.log.info(
                "weights_mirrored",
                version=remote.version,
                bytes=remote.handle.size,
                seconds=round(time.perf_counter() - t0, 4),
            )
            return local.manifest

    async def _fetch(self, obs: Any, remote: WeightManifest) -> Version:
        """The version's object in a new local shm file, checksum-verified."""
        path = self.store.path(remote.version)
        buf = shm.create_map(path, remote.handle.size)
        try:
            await read_into(obs, subjects.weight_object(remote.version), buf)
            digest = await asyncio.to_thread(core.checksum, buf)
            if digest != remote.checksum:
                raise InvalidRequest(
                    "mirrored weights checksum mismatch", version=remote.version, got=digest
                )
        except BaseException:
            shm.unlink(path)
            raise
        manifest = msgspec.structs.replace(
            remote,
            handle=shm.shm_handle(path, remote.handle.size),
            model_dir=str(self.store.model_dir),
            created_at=time.time(),
        )
        return Version(manifest=manifest, buf=buf)
