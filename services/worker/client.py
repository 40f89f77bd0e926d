"""What other services use of the rollout worker: its config (the supervisor starts main
workers and shadows from it, ``--role main|shadow``). Everything else is on the bus: the
engine's subjects are documented in docs/protocol.md."""

from __future__ import annotations

from services.worker.config import WorkerConfig

__all__ = ["WorkerConfig"]
