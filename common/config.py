"""Node-wide paths and names shared by the CLI, the supervisor and the services.

Per-service settings live in one frozen dataclass per service (``services/<name>/config.py``);
this module only holds what several of them must agree on: where the run directory is and how
shared-memory files are named (so ``belayer down`` can remove every one of them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class RunPaths:
    """Layout of a node's run directory (default ``./.belayer``)."""

    root: Path

    @classmethod
    def default(cls) -> RunPaths:
        return cls(Path(os.environ.get("BELAYER_HOME", ".belayer")).resolve())

    @property
    def node_file(self) -> Path:
        """JSON written by ``up``: nats_url, supervisor pid, run id."""
        return self.root / "node.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def nats_store(self) -> Path:
        return self.root / "nats"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeat"

    @property
    def models(self) -> Path:
        return self.root / "models"

    def heartbeat_file(self, engine_id: str) -> Path:
        return self.heartbeats / f"{engine_id}.hb"


def shm_prefix(run_id: str) -> str:
    """Prefix of every /dev/shm file this node creates."""
    return f"belayer-{run_id}-"


def shm_path(run_id: str, name: str) -> Path:
    """A shared-memory file of this node."""
    return SHM_DIR / f"{shm_prefix(run_id)}{name}"
