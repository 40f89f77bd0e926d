"""The interfaces around the sandbox manager: what it needs of the bus (``ReadyStore``) and what
its two helpers may use of it (``Fleet`` for ``lifecycle``, ``RestoreHost`` for ``restore``).

The helpers take these, not the ``SandboxManager``: each names exactly the attributes and
operations it uses, so neither can reach the manager's own state (its restore method cache,
its background removals, its freezer cache, its per-sandbox lock context) and mypy checks that
the manager still offers what they need.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

from schemas.env import CheckpointInfo, ReadyPointer
from services.environment.config import EnvConfig
from services.environment.core import Manifest, SandboxRecord
from services.environment.docker_ops import DockerOps


class ReadyStore(Protocol):
    """Where ready pointers live (JetStream KV in production)."""

    async def get(self, sandbox_id: str) -> tuple[ReadyPointer | None, int]: ...

    async def advance(self, pointer: ReadyPointer, expected_rev: int) -> int: ...

    async def delete(self, sandbox_id: str) -> None: ...

    async def announce(self, info: CheckpointInfo) -> None: ...


class CheckpointStore(Protocol):
    """Where ready checkpoints are kept beyond this host (the JetStream Object Store,
    ``objects.CheckpointObjects``)."""

    async def put(self, checkpoint_id: str, directory: Path) -> None: ...

    async def fetch(self, checkpoint_id: str, directory: Path) -> None: ...

    async def delete(self, checkpoint_id: str) -> None: ...


class Fleet(Protocol):
    """What start-up and stop (``lifecycle``) use of the manager: the sandbox table with its
    locks, Docker, the ready pointers, and four operations on one sandbox or all."""

    config: EnvConfig
    docker: DockerOps
    store: ReadyStore
    records: dict[str, SandboxRecord]
    locks: dict[str, asyncio.Lock]

    async def running(self, rec: SandboxRecord) -> bool: ...

    def save(self, rec: SandboxRecord) -> None: ...

    async def remove(self, rec: SandboxRecord) -> None: ...

    async def settle(self) -> None: ...


class RestoreHost(Protocol):
    """What ``restore.full_restore`` uses of the manager: Docker, the ready pointers, where a
    sandbox's checkpoints are and which are there, how restores start containers, and the
    two effects of a successful restore (the record saved, the replaced container retired)."""

    config: EnvConfig
    docker: DockerOps
    store: ReadyStore

    def sandbox_dir(self, sandbox_id: str) -> Path: ...

    def manifests(self, sandbox_id: str) -> list[Manifest]: ...

    async def restore_method(self) -> str: ...

    def save(self, rec: SandboxRecord) -> None: ...

    def retire(self, container_id: str) -> None: ...
