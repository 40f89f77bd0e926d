"""The weight store's state: immutable versions, each one shm file, and their lifecycle.

Synchronous and bus-free (``service.py`` adapts it to NATS and runs the heavy calls in a
thread). A version is written completely, checksummed, and only then published; it is never
modified afterwards, so a reader that maps one manifest sees exactly one version.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from pathlib import Path

from common import shm
from common.config import shm_path, shm_prefix
from common.errors import Conflict, InvalidRequest, NotFound
from common.logging import get_logger
from model.config import load_model_config
from model.loader import read_raw
from schemas.weights import WeightManifest, WeightsPush
from services.weights import core

FILE_PREFIX = "weights-v"
"""Name of a version's shm file after the run prefix: ``weights-v<N>``."""


@dataclass
class Version:
    """One published (or about to be published) weight version and the memory holding it."""

    manifest: WeightManifest
    buf: mmap.mmap
    """The store's own mapping of the version's memory (bytes; the store never imports
    torch)."""


class WeightStore:
    """Versions of one model in shared memory; the newest ``keep_versions`` are kept."""

    def __init__(
        self, run_id: str, model_dir: Path, keep_versions: int = 2, first_version: int = 1
    ) -> None:
        self.run_id = run_id
        self.model_dir = Path(model_dir).resolve()
        self.keep_versions = keep_versions
        self.first_version = first_version
        # Bound here, not at import: structlog is configured in __main__ after imports.
        self.log = get_logger(component="weight_store", run_id=run_id)
        self.versions: dict[int, Version] = {}
        self.current = 0
        """Version number readers get by default; 0 until :meth:`start`."""

    # --- startup ------------------------------------------------------------------------
    def start(self, prior: WeightManifest | None) -> WeightManifest:
        """Make the first version current and return its manifest.

        ``prior`` is the manifest the ``weight_version`` bucket points at. If it belongs to
        this run and its memory is intact (the store was killed and restarted), it is
        adopted: a trainer's pushed weights survive a store crash. Otherwise the model
        directory is loaded as version ``first_version`` (or ``prior.version + 1`` within the
        same run, so version numbers never repeat). Stale files of this run are removed either
        way.
        """
        adopted = self._adopt(prior) if prior is not None else None
        if adopted is None:
            same_run = prior is not None and self._owns(prior.handle.path)
            number = prior.version + 1 if prior is not None and same_run else self.first_version
            adopted = self._load(number)
        self.versions[adopted.manifest.version] = adopted
        self.current = adopted.manifest.version
        for path in shm.list_files(self.run_id, FILE_PREFIX):
            if str(path) != adopted.manifest.handle.path:
                shm.unlink(path)
                self.log.info("stale_version_removed", path=str(path))
        return adopted.manifest

    def _owns(self, path: str) -> bool:
        return Path(path).name.startswith(shm_prefix(self.run_id) + FILE_PREFIX)

    def _adopt(self, prior: WeightManifest) -> Version | None:
        if (
            not self._owns(prior.handle.path)
            or prior.handle.kind != "shm"
            or prior.model_dir != str(self.model_dir)
        ):
            return None
        try:
            buf = shm.attach_map(prior.handle)
        except (NotFound, InvalidRequest):
            return None
        if core.checksum(buf) != prior.checksum:
            self.log.warning(
                "adopt_checksum_mismatch", version=prior.version, path=prior.handle.path
            )
            return None
        self.log.info("version_adopted", version=prior.version, path=prior.handle.path)
        return Version(manifest=prior, buf=buf)

    def _load(self, number: int) -> Version:
        t0 = time.perf_counter()
        load_model_config(self.model_dir)  # refuse unsupported architectures before copying
        try:
            raw = read_raw(self.model_dir)
        except ValueError as exc:
            raise InvalidRequest("the model's weights are unreadable", reason=str(exc)) from None
        layout = core.plan_layout({name: (t.dtype, t.shape) for name, t in raw.items()})
        path = self.path(number)
        buf = shm.create_map(path, layout.size)
        try:
            core.pack({name: t.data for name, t in raw.items()}, layout, buf)
            digest = core.checksum(buf)
        except BaseException:
            shm.unlink(path)
            raise
        manifest = self._manifest(number, path, layout, digest)
        self.log.info(
            "model_loaded",
            version=number,
            tensors=len(layout.tensors),
            bytes=layout.size,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return Version(manifest=manifest, buf=buf)

    # --- reads --------------------------------------------------------------------------
    def get(self, version: int | None = None) -> WeightManifest:
        """The manifest of ``version`` (default: current); ``NotFound`` if not kept."""
        number = self.current if version is None else version
        found = self.versions.get(number)
        if found is None:
            raise NotFound(
                "unknown weight version",
                version=number,
                available=",".join(map(str, sorted(self.versions))),
            )
        return found.manifest

    # --- pushes -------------------------------------------------------------------------
    def ingest(self, push: WeightsPush) -> Version:
        """Validate a push and copy it into a fresh shm file as version ``current + 1``.

        The new version is *not* current yet: call :meth:`publish` (after the bus pointer
        moved) or :meth:`discard`. Raises ``Conflict`` for a stale ``base_version`` and
        ``InvalidRequest`` for a layout or checksum that does not match.
        """
        if push.base_version != self.current:
            raise Conflict(
                "stale base_version: weights were pushed since",
                base_version=push.base_version,
                current=self.current,
            )
        cur = self.versions[self.current].manifest
        core.validate_layout(push.tensors, push.handle.size)
        core.validate_push(cur.tensors, push.tensors)
        src = shm.attach_map(push.handle)
        number = self.current + 1
        path = self.path(number)
        dst = shm.create_map(path, cur.handle.size)
        try:
            digest = self._copy(push, src, cur, dst)
        except BaseException:
            shm.unlink(path)
            raise
        layout = core.Layout(tensors=cur.tensors, size=cur.handle.size)
        return Version(manifest=self._manifest(number, path, layout, digest), buf=dst)

    @staticmethod
    def _copy(push: WeightsPush, src: mmap.mmap, cur: WeightManifest, dst: mmap.mmap) -> str:
        """Copy the pushed bytes into ``dst`` and return ``dst``'s checksum, after checking
        the pusher's checksum against the bytes it actually sent."""
        if push.handle.size == cur.handle.size and core.same_placement(cur.tensors, push.tensors):
            memoryview(dst)[:] = memoryview(src)
            # Hash our private copy, not the pusher's memory: it cannot change under us.
            digest = core.checksum(dst)
            if digest != push.checksum:
                raise InvalidRequest("checksum mismatch", expected=push.checksum, got=digest)
            return digest
        got = core.checksum(src)
        if got != push.checksum:
            raise InvalidRequest("checksum mismatch", expected=push.checksum, got=got)
        core.repack(src, push.tensors, dst, cur.tensors)
        return core.checksum(dst)

    def publish(self, version: Version) -> list[int]:
        """Make an ingested version current; unlink versions beyond ``keep_versions``.
        Returns the version numbers collected."""
        number = version.manifest.version
        self.versions[number] = version
        self.current = number
        collected: list[int] = []
        for old in sorted(self.versions)[: -self.keep_versions]:
            dropped = self.versions.pop(old)
            shm.unlink(dropped.manifest.handle.path)
            collected.append(old)
        return collected

    def discard(self, version: Version) -> None:
        """Forget an ingested version that was never published."""
        shm.unlink(version.manifest.handle.path)

    def close(self) -> list[str]:
        """Unlink every file of every version (mappings elsewhere stay valid)."""
        removed = [str(p) for p in shm.list_files(self.run_id, FILE_PREFIX) if shm.unlink(p)]
        self.versions.clear()
        return removed

    # --- helpers ------------------------------------------------------------------------
    def path(self, number: int) -> Path:
        """The shm file of version ``number``."""
        return shm_path(self.run_id, f"{FILE_PREFIX}{number}")

    def _manifest(
        self, number: int, path: Path, layout: core.Layout, digest: str
    ) -> WeightManifest:
        return WeightManifest(
            version=number,
            handle=shm.shm_handle(path, layout.size),
            tensors=layout.tensors,
            checksum=digest,
            model_dir=str(self.model_dir),
            created_at=time.time(),
        )
