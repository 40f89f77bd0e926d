"""Ready checkpoints in the JetStream Object Store ``checkpoints``, so that a checkpoint
outlives the host that took it: one object per checkpoint (name: the checkpoint id), an
uncompressed tar of its directory (``manifest.json``, ``fs.tar``, ``criu/*``).

The store adds nothing to what a restore trusts: an object is unpacked only into a fresh
directory, only the files of a checkpoint's layout (regular files, no links, no paths out),
and the restore then verifies it exactly as a local one — the manifest's digest against the
ready pointer's, every artifact against the manifest (``snapshot.validate``). The Object
Store's own SHA-256 of the object catches a torn transfer first.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.object_store import ObjectStore

from common import subjects
from common.errors import BusUnavailable, CheckpointInvalid, NotFound
from common.logging import get_logger
from services.environment import core
from services.environment import criu_ops as ops

log = get_logger(component="env.objects")
PACK_PREFIX = ".pack-"
"""Temporary tar files beside the checkpoint directories (removed after each transfer)."""


@contextlib.contextmanager
def _transfer(doing: str, checkpoint_id: str, pack: Path) -> Iterator[None]:
    """One transfer through the object store: a bus failure in it is ``BusUnavailable``
    ("cannot <doing>"), and the temporary tar ``pack`` is removed however it ends."""
    try:
        yield
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusUnavailable(f"cannot {doing}: {exc!r}", checkpoint_id=checkpoint_id) from None
    finally:
        pack.unlink(missing_ok=True)


class CheckpointObjects:
    """Put, fetch and delete checkpoints in the object store (``ports.CheckpointStore``)."""

    def __init__(self, js: JetStreamContext, bucket: str = subjects.OBJECT_STORE_CHECKPOINTS):
        self.js = js
        self.bucket = bucket
        self._obs: ObjectStore | None = None

    async def store(self) -> ObjectStore:
        if self._obs is None:
            try:
                self._obs = await self.js.object_store(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                raise BusUnavailable(
                    "the checkpoint object store does not exist (the node declares it)",
                    bucket=self.bucket,
                ) from None
            except (TimeoutError, nats.errors.Error) as exc:
                raise BusUnavailable(f"cannot open the checkpoint object store: {exc!r}") from None
        return self._obs

    async def put(self, checkpoint_id: str, directory: Path) -> None:
        """Store the checkpoint in ``directory`` (blocking work off the event loop)."""
        obs = await self.store()
        pack = directory.parent / f"{PACK_PREFIX}{checkpoint_id}.tar"
        with _transfer("store the checkpoint in the object store", checkpoint_id, pack):
            await asyncio.to_thread(pack_checkpoint, directory, pack)
            with pack.open("rb") as f:
                await obs.put(checkpoint_id, f)

    async def fetch(self, checkpoint_id: str, directory: Path) -> None:
        """Fetch a checkpoint into ``directory`` (which must not exist yet): written under a
        temporary name and renamed whole, like a checkpoint taken here."""
        obs = await self.store()
        directory.parent.mkdir(parents=True, exist_ok=True)
        pack = directory.parent / f"{PACK_PREFIX}{checkpoint_id}.tar"
        tmp = directory.parent / f"{core.TMP_PREFIX}{checkpoint_id}"
        with _transfer("fetch the checkpoint from the object store", checkpoint_id, pack):
            try:
                with pack.open("wb") as f:
                    await obs.get(checkpoint_id, writeinto=f)
                await asyncio.to_thread(unpack_checkpoint, pack, tmp)
                tmp.rename(directory)
            except nats.js.errors.ObjectNotFoundError:
                raise NotFound(
                    "checkpoint not in the object store", checkpoint_id=checkpoint_id
                ) from None
            except nats.js.errors.DigestMismatchError:
                raise CheckpointInvalid(
                    "checkpoint object digest mismatch", checkpoint_id=checkpoint_id
                ) from None
            finally:
                ops.remove_tree(tmp)
        log.info("checkpoint_fetched", checkpoint_id=checkpoint_id)

    async def delete(self, checkpoint_id: str) -> None:
        """Delete one object (absent: nothing to do; a bus failure is logged: the bucket's
        TTL removes what is left)."""
        try:
            obs = await self.store()
            with contextlib.suppress(
                nats.js.errors.ObjectNotFoundError, nats.js.errors.NotFoundError
            ):
                await obs.delete(checkpoint_id)
        except (BusUnavailable, TimeoutError, nats.errors.Error) as exc:
            log.warning(
                "checkpoint_object_delete_failed", checkpoint_id=checkpoint_id, error=repr(exc)
            )


def pack_checkpoint(directory: Path, out: Path) -> None:
    """Blocking: the checkpoint's regular files into an uncompressed tar at ``out``."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(_layout_files(directory)):
            tar.add(path, arcname=path.relative_to(directory).as_posix(), recursive=False)


def _layout_files(directory: Path) -> list[Path]:
    files = [directory / core.MANIFEST, directory / core.FS_ARCHIVE]
    criu = directory / core.CRIU_DIR
    if criu.is_dir():
        files += [p for p in criu.iterdir() if p.is_file() and not p.is_symlink()]
    return [p for p in files if p.is_file()]


def allowed_member(name: str) -> bool:
    """Whether a tar member name is a file of a checkpoint's layout."""
    if name in (core.MANIFEST, core.FS_ARCHIVE):
        return True
    head, _, leaf = name.partition("/")
    return head == core.CRIU_DIR and bool(leaf) and "/" not in leaf and not leaf.startswith(".")


def unpack_checkpoint(pack: Path, directory: Path) -> None:
    """Blocking: unpack a stored checkpoint into the new ``directory``: regular files of the
    checkpoint layout only; anything else makes the object ``CheckpointInvalid``."""
    ops.remove_tree(directory)
    (directory / core.CRIU_DIR).mkdir(parents=True)
    try:
        with tarfile.open(pack, "r:") as tar:
            for member in tar:
                if not member.isfile() or not allowed_member(member.name):
                    raise CheckpointInvalid(
                        "unexpected entry in a stored checkpoint", name=member.name[:200]
                    )
                src = tar.extractfile(member)
                assert src is not None  # a regular file
                with src, (directory / member.name).open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except tarfile.TarError as exc:
        raise CheckpointInvalid("stored checkpoint is not a readable tar", error=str(exc)) from None
