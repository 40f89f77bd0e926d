"""What the CLI, the benchmarks and the tests use of the node supervisor: its status (every
process it runs), the request to stop the node, and two facts of a node's layout that need no
running supervisor (the identities its processes connect as, the shared-memory files it owns)."""

from __future__ import annotations

import contextlib

from nats.aio.client import Client as NATS

from common import subjects
from common.bus import request
from common.config import SHM_DIR, shm_prefix
from schemas.base import Ok
from schemas.node import StopNode, SupervisorStatus, SupervisorStatusRequest
from services.supervisor.config import SupervisorConfig, host_engine_ids

__all__ = [
    "SupervisorConfig",
    "node_identity_names",
    "remove_shm_files",
    "stop_node",
    "supervisor_status",
]


async def supervisor_status(nc: NATS, *, timeout: float = 5.0) -> SupervisorStatus:
    """Every process the supervisor runs (name, pid, alive, restarts) and the node's state."""
    return await request(
        nc,
        subjects.supervisor_status(),
        SupervisorStatusRequest(),
        SupervisorStatus,
        timeout=timeout,
    )


async def stop_node(nc: NATS, reason: str, *, timeout: float = 3.0) -> Ok:
    """Ask the supervisor to stop the node (it drains every service, then exits)."""
    return await request(
        nc, subjects.supervisor_stop(), StopNode(reason=reason), Ok, timeout=timeout
    )


def node_identity_names(config: SupervisorConfig) -> list[str]:
    """The identities a node's processes connect as (``<creds dir>/<name>.nk`` each)."""
    if config.role == "env-host":
        return ["host", "environment"]
    if config.role == "engine-host":
        ids = host_engine_ids(config.host_name, config.engines)
        return ["host", "weights", "kv", *(f"engine-{e}" for e in ids)]
    names = ["supervisor", "weights", "kv", "router", "controller"]
    names += [f"engine-e{i}" for i in range(config.engines)]
    names += ["environment"] if config.environment else []
    names += ["trainer"] if config.training else []
    return names


def remove_shm_files(run_id: str) -> int:
    """Delete every /dev/shm file of this node (services normally did already)."""
    n = 0
    for p in SHM_DIR.glob(f"{shm_prefix(run_id)}*"):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            n += 1
    return n
