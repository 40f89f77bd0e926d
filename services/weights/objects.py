"""Weight versions in a JetStream Object Store, for engines on other hosts.

The node's weight store *exports* a version on request (``weights.export``): it puts the
version's flat buffer into the ``weight_objects`` bucket as object ``v<N>`` (chunked by the
Object Store, its sha256 digest in the object's info) and the model's ``config.json`` beside
it (and the tokenizer's files, which set the engine's output vocabulary), once per version,
and removes the objects of versions it no longer keeps. An engine
host's mirror (``mirror.py``) reads an object straight into its own shared memory; the
Object Store checks the chunk digest, the mirror then the version's own checksum.
"""

from __future__ import annotations

import asyncio
import io
import mmap
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.object_store import ObjectStore

from common import subjects
from common.errors import BusUnavailable, InvalidRequest, NotFound
from schemas.weights import WeightManifest, WeightsGet
from services.weights.store import WeightStore

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
"""The model directory's small files an engine host mirrors (those present)."""


async def open_bucket(
    js: JetStreamContext, *, create: bool = False, replicas: int = 1
) -> ObjectStore:
    """The ``weight_objects`` Object Store; with ``create``, made if missing (the node's
    weight store, whose identity may). ``BusUnavailable`` when it cannot be opened."""
    bucket = subjects.BUCKET_WEIGHT_OBJECTS
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            raise BusUnavailable("no weight objects yet: the node exported none") from None
    except (nats.errors.Error, TimeoutError) as exc:
        raise BusUnavailable(f"object store {bucket} unavailable: {exc!r}") from None
    config = ObjectStoreConfig(bucket=bucket, storage=StorageType.FILE, replicas=replicas)
    return await js.create_object_store(bucket, config=config)


class _Bytes(io.RawIOBase):
    """A position in the bytes of a version's mapping, in place (no copy of the whole
    version)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.view = memoryview(buf)
        self.pos = 0


class _Reader(_Bytes):
    """Reads a version's mapping in place."""

    def readable(self) -> bool:
        return True

    def readinto(self, out: Any) -> int:
        n = min(len(out), len(self.view) - self.pos)
        out[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n


class _Writer(_Bytes):
    """Writes object chunks into a version's mapping, refusing more than it holds."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = len(data)
        if self.pos + n > len(self.view):
            raise InvalidRequest("weight object larger than its manifest says", size=len(self.view))
        self.view[self.pos : self.pos + n] = data
        self.pos += n
        return n


async def read_into(obs: ObjectStore, name: str, buf: mmap.mmap) -> None:
    """Object ``name`` written into ``buf`` (its exact size); the Object Store checks the
    chunks' sha256 against the object's digest. ``NotFound``/``InvalidRequest`` otherwise."""
    writer = _Writer(buf)
    try:
        await obs.get(name, writeinto=writer)  # type: ignore[arg-type]  # any object with write()
    except nats.js.errors.ObjectNotFoundError:
        raise NotFound("weight object not exported", object=name) from None
    except nats.js.errors.DigestMismatchError:
        raise InvalidRequest("weight object digest mismatch", object=name) from None
    if writer.pos != len(buf):
        raise InvalidRequest("weight object size differs", object=name, got=writer.pos)


async def read_model_files(obs: ObjectStore, model_dir: Path) -> list[str]:
    """The model's small files written into ``model_dir`` (digest-checked); their names.
    ``NotFound`` without a ``config.json``."""
    got = []
    for name in MODEL_FILES:
        try:
            data = await read_bytes(obs, subjects.model_file_object(name))
        except NotFound:
            if name == "config.json":
                raise
            continue
        await asyncio.to_thread(_write_file, model_dir / name, data)
        got.append(name)
    return got


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


async def read_bytes(obs: ObjectStore, name: str) -> bytes:
    """A small object (one of the model's files), digest-checked."""
    try:
        return bytes((await obs.get(name)).data or b"")
    except nats.js.errors.ObjectNotFoundError:
        raise NotFound("weight object not exported", object=name) from None
    except nats.js.errors.DigestMismatchError:
        raise InvalidRequest("weight object digest mismatch", object=name) from None


class Exporter:
    """The node's side: ``weights.export`` puts a kept version into the bucket once."""

    def __init__(self, js: JetStreamContext, store: WeightStore, replicas: int, log: Any) -> None:
        self.js = js
        self.store = store
        self.replicas = replicas
        self.log = log
        self.lock = asyncio.Lock()
        self.exported: set[int] = set()
        self.obs: ObjectStore | None = None

    async def export(self, req: WeightsGet, _msg: Any) -> WeightManifest:
        async with self.lock:
            manifest = self.store.get(req.version)  # NotFound for a version not kept
            version = self.store.versions[manifest.version]
            if self.obs is None:
                self.obs = await open_bucket(self.js, create=True, replicas=self.replicas)
                for name in MODEL_FILES:
                    path = Path(manifest.model_dir) / name
                    if await asyncio.to_thread(path.is_file):
                        data = await asyncio.to_thread(path.read_bytes)
                        await self.obs.put(subjects.model_file_object(name), data)
            if manifest.version not in self.exported:
                await self.obs.put(subjects.weight_object(manifest.version), _Reader(version.buf))  # type: ignore[arg-type]  # a reader
                self.exported.add(manifest.version)
                self.log.info(
                    "weights_exported", version=manifest.version, bytes=manifest.handle.size
                )
            for old in sorted(self.exported - set(self.store.versions)):
                await self.obs.delete(subjects.weight_object(old))
                self.exported.discard(old)
            return manifest
