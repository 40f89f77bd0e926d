"""The arenas themselves: one zero-filled shm file per engine, shaped
``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (``model.kv_cache_shape``).

Synchronous and bus-free. The memory belongs to this service, not to any worker: a worker
that crashes leaves the arena intact, and the shadow that takes over maps the same file.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from common import shm
from common.config import shm_path
from common.dtypes import nbytes
from common.errors import Conflict, NotFound
from common.logging import get_logger
from schemas.weights import ArenaDesc

FILE_PREFIX = "kv-"
"""Name of an arena's shm file after the run prefix: ``kv-<engine_id>``."""


@dataclass
class Arena:
    """One engine's block pool and its flush bookkeeping."""

    engine_id: str
    path: Path
    buf: mmap.mmap
    """This service's mapping (bytes: the arena never imports torch; workers map the file as
    a tensor)."""
    shape: tuple[int, ...]
    dtype: str
    """Wire dtype name of the elements (``float32``…)."""
    block_size: int
    num_blocks: int
    generation: int = 0
    epoch: int = 0
    """Engine epoch of the last accepted flush: each epoch's arena is flushed once."""
    adopted: bool = False
    """The file existed (this service restarted): live workers may be using it."""

    def desc(self) -> ArenaDesc:
        """The wire descriptor workers map."""
        return ArenaDesc(
            engine_id=self.engine_id,
            handle=shm.shm_handle(self.path, len(self.buf)),
            shape=list(self.shape),
            dtype=self.dtype,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            generation=self.generation,
            epoch=self.epoch,
        )


class ArenaPool:
    """The arenas of every engine of a node."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.arenas: dict[str, Arena] = {}
        # Bound here, not at import: structlog is configured in __main__ after imports.
        self.log = get_logger(component="kv_arena", run_id=run_id)

    def allocate(
        self,
        engine_id: str,
        shape: tuple[int, ...],
        dtype: str,
        block_size: int,
    ) -> Arena:
        """Create the engine's zero-filled arena, or adopt an existing file of the same
        size: after a crash of this service, live workers still map that file, and a new
        file under the same name would split them from their shadows."""
        path = shm_path(self.run_id, f"{FILE_PREFIX}{engine_id}")
        size = nbytes(dtype, shape)
        buf = self._adopt(path, size)
        adopted = buf is not None
        if buf is None:
            shm.unlink(path)
            buf = shm.create_map(path, size)
            self.log.info("arena_allocated", engine_id=engine_id, bytes=size, shape=list(shape))
        arena = Arena(
            engine_id=engine_id,
            path=path,
            buf=buf,
            shape=shape,
            dtype=dtype,
            block_size=block_size,
            num_blocks=shape[2],
            adopted=adopted,
        )
        self.arenas[engine_id] = arena
        return arena

    def _adopt(self, path: Path, size: int) -> mmap.mmap | None:
        try:
            if os.stat(path).st_size != size:
                return None
            buf = shm.attach_map(shm.shm_handle(path, size))
        except (FileNotFoundError, NotFound):
            return None
        self.log.info("arena_adopted", path=str(path), bytes=size)
        return buf

    def remove_strays(self) -> list[str]:
        """Unlink arena files of this run that belong to no configured engine."""
        keep = {str(a.path) for a in self.arenas.values()}
        strays = [p for p in shm.list_files(self.run_id, FILE_PREFIX) if str(p) not in keep]
        return [str(p) for p in strays if shm.unlink(p)]

    def get(self, engine_id: str) -> Arena:
        """The arena of ``engine_id``; ``NotFound`` for an engine this node does not run."""
        arena = self.arenas.get(engine_id)
        if arena is None:
            raise NotFound(
                "unknown engine", engine_id=engine_id, engines=",".join(sorted(self.arenas))
            )
        return arena

    def flush(self, engine_id: str, epoch: int, claimed_epoch: int) -> Arena:
        """Zero the engine's whole arena and bump its generation.

        Only under the epoch claimed in ``engine_epochs`` (``claimed_epoch``), and only once
        per epoch (``Conflict`` otherwise): the worker that just won the compare-and-set
        flushes before it uses the arena, so nobody can wipe a live worker's KV — not a
        residual old worker, not a replay, not a made-up epoch pushed out of reach.
        """
        arena = self.get(engine_id)
        if epoch != claimed_epoch:
            raise Conflict(
                "flush under an epoch that is not the engine's claimed one",
                engine_id=engine_id,
                epoch=epoch,
                claimed_epoch=claimed_epoch,
            )
        if epoch <= arena.epoch:
            raise Conflict(
                "stale epoch: this arena was already flushed under it",
                engine_id=engine_id,
                epoch=epoch,
                current_epoch=arena.epoch,
            )
        shm.zero(arena.buf)
        arena.generation += 1
        arena.epoch = epoch
        return arena

    def close(self) -> list[str]:
        """Unlink every arena file of this run (mappings elsewhere stay valid)."""
        removed = [str(p) for p in shm.list_files(self.run_id, FILE_PREFIX) if shm.unlink(p)]
        self.arenas.clear()
        return removed
