"""What other services use of the rollout worker.

The shadow service embeds a complete, prepared worker (a standby *is* a worker that has not
claimed its engine yet), so the worker's public API is the in-process ``Worker`` and its
config, next to the engine's bus subjects documented in ``docs/protocol.md``. The supervisor
only needs ``WorkerConfig`` (to start workers from it): ``Worker``, which pulls in torch, is
imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.worker.config import WorkerConfig

if TYPE_CHECKING:
    from services.worker.service import Worker

__all__ = ["Worker", "WorkerConfig"]


def __getattr__(name: str) -> Any:
    if name == "Worker":
        from services.worker.service import Worker

        return Worker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
