"""What other services use of the rollout worker.

The shadow service embeds a complete, prepared worker (a standby *is* a worker that has not
claimed its engine yet), so the worker's public API is the in-process ``Worker`` and its
config, next to the engine's bus subjects documented in ``docs/protocol.md``."""

from __future__ import annotations

from services.worker.config import WorkerConfig
from services.worker.service import Worker

__all__ = ["Worker", "WorkerConfig"]
