"""Typed client of the environment service (used by the CLI, the benchmark, the controller),
the node-side cleanup ``belayer down`` and the supervisor run after the service stopped, and
a private environment service for a caller without a node (``with_private_env``: the warm
start's demonstrations, ``belayer model eval``)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client as NATS

from common import subjects
from common.bus import request
from schemas.base import Ok
from schemas.env import (
    CheckpointInfo,
    EnvCheckpoint,
    EnvCreate,
    EnvCreated,
    EnvDestroy,
    EnvExec,
    EnvExecResult,
    EnvGc,
    EnvList,
    EnvListing,
    EnvRestore,
    EnvRestored,
    SandboxLimits,
    TaskFile,
)
from services.environment.config import EnvConfig

T = TypeVar("T")


class EnvClient:
    """One method per ``belayer.env.<op>``; errors arrive as typed ``common.errors``."""

    def __init__(self, nc: NATS, *, timeout: float = 60.0) -> None:
        self.nc = nc
        self.timeout = timeout

    async def create(
        self,
        *,
        image: str = "",
        files: dict[str, bytes] | None = None,
        limits: SandboxLimits | None = None,
        trajectory_id: str = "",
        sandbox_id: str = "",
    ) -> EnvCreated:
        msg = EnvCreate(
            image=image,
            files=[TaskFile(path=p, content=c) for p, c in (files or {}).items()],
            limits=limits or SandboxLimits(),
            trajectory_id=trajectory_id,
            sandbox_id=sandbox_id,
        )
        return await request(self.nc, subjects.env("create"), msg, EnvCreated, timeout=self.timeout)

    async def exec(self, sandbox_id: str, command: str, timeout_s: float = 30.0) -> EnvExecResult:
        msg = EnvExec(sandbox_id=sandbox_id, command=command, timeout_s=timeout_s)
        return await request(
            self.nc, subjects.env("exec"), msg, EnvExecResult, timeout=timeout_s + self.timeout
        )

    async def checkpoint(
        self, sandbox_id: str, prefix: int, trajectory_id: str = "", timeout_s: float = 0.0
    ) -> CheckpointInfo:
        msg = EnvCheckpoint(
            sandbox_id=sandbox_id, prefix=prefix, trajectory_id=trajectory_id, timeout_s=timeout_s
        )
        return await request(
            self.nc,
            subjects.env("checkpoint"),
            msg,
            CheckpointInfo,
            timeout=self.timeout + timeout_s,
        )

    async def restore(self, sandbox_id: str, checkpoint_id: str = "") -> EnvRestored:
        msg = EnvRestore(sandbox_id=sandbox_id, checkpoint_id=checkpoint_id)
        return await request(
            self.nc, subjects.env("restore"), msg, EnvRestored, timeout=self.timeout * 2
        )

    async def destroy(self, sandbox_id: str) -> Ok:
        return await request(
            self.nc,
            subjects.env("destroy"),
            EnvDestroy(sandbox_id=sandbox_id),
            Ok,
            timeout=self.timeout,
        )

    async def list(self) -> EnvListing:
        return await request(
            self.nc, subjects.env("list"), EnvList(), EnvListing, timeout=self.timeout
        )

    async def gc(self, trajectory_id: str) -> Ok:
        return await request(
            self.nc,
            subjects.env("gc"),
            EnvGc(trajectory_id=trajectory_id),
            Ok,
            timeout=self.timeout,
        )


def node_label(run_id: str) -> str:
    """The ``belayer.node`` container label of the sandboxes of the node with this run id: the
    supervisor starts the environment service with it, ``belayer down`` finds leftovers by it
    (the run id is in the node file, so this works even after the service died). Ownership
    across runs is the run directory's ``belayer.run`` label (``EnvConfig.run_key``)."""
    return f"node-{run_id}"


def keep_sandboxes(run_dir: Path, keep: bool) -> bool:
    """Before a node stops: with ``keep``, mark the run directory so that its sandboxes (and
    their checkpoints and records) survive the stop and the next ``belayer up`` of this run
    directory adopts them; without, clear any such mark (the stop destroys them). Returns
    whether the run directory has an environment at all (nothing to keep otherwise)."""
    config = EnvConfig(run_dir=run_dir)
    if not config.env_dir.is_dir():
        return False
    if keep:
        config.keep_marker.write_text("kept by belayer down --keep-sandboxes\n")
    else:
        config.keep_marker.unlink(missing_ok=True)
    return True


@dataclass(frozen=True)
class SandboxCleanup:
    """What ``remove_node_sandboxes`` removed."""

    containers: int = 0
    """Sandbox containers of the node removed."""
    checkpoint_dirs: int = 0
    """Sandbox checkpoint directories removed (with the sandbox records)."""
    error: str = ""
    """Why the node's containers could not be listed (dockerd unreachable), else empty."""
    kept: int = 0
    """Sandboxes left in place for the next start (``keep_sandboxes``): nothing was removed."""


def remove_node_sandboxes(node: str, run_dir: Path) -> SandboxCleanup:
    """Blocking. Remove every container labelled ``belayer.node=<node>`` or
    ``belayer.run=<run_dir's key>``, then every sandbox's checkpoint directory and record under
    ``run_dir`` (sandboxes do not outlive their node). Call it only once the node's environment
    service has stopped. A run directory where no environment service ever ran is left alone
    (no Docker call), and so is one marked by ``keep_sandboxes`` (``kept`` counts its
    sandboxes); with dockerd unreachable nothing is removed and ``error`` says why."""
    config = EnvConfig(run_dir=run_dir, node=node)
    if not config.env_dir.is_dir():
        return SandboxCleanup()
    if config.keep_marker.exists():
        return SandboxCleanup(kept=len(list(config.records_dir.glob("*.json"))))
    from common.errors import SandboxError
    from services.environment.docker_ops import DockerOps

    containers = 0
    docker = DockerOps(config)
    try:
        for cid, _sid in docker.labelled():
            docker.remove(cid)
            containers += 1
    except SandboxError as exc:  # keep the records: a retry once dockerd answers finds them
        return SandboxCleanup(containers=containers, error=str(exc))
    dirs = [p for p in _entries(config.checkpoint_root) if p.is_dir()]
    for p in dirs:
        shutil.rmtree(p, ignore_errors=True)
    for p in _entries(config.records_dir):
        p.unlink(missing_ok=True)
    return SandboxCleanup(containers=containers, checkpoint_dirs=len(dirs))


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []


async def with_private_env(fn: Callable[[EnvClient], Awaitable[T]]) -> T:
    """Run ``fn(ops)`` against a private environment service (its own nats-server, run
    directory and node label, so no other node's sandboxes are touched); every sandbox it
    made is destroyed before it stops."""
    from common.bus import connect, ensure_jetstream
    from common.errors import SandboxError
    from common.natsserver import start_nats_server
    from services.environment.service import run as run_env

    with tempfile.TemporaryDirectory(prefix="belayer-warm-") as tmp:
        server = start_nats_server(Path(tmp) / "nats")
        try:
            nc = await connect(server.url, name="warm-start", timeout=5.0, reconnect=False)
            try:
                await ensure_jetstream(nc.jetstream())
                config = EnvConfig(
                    nats_url=server.url,
                    run_dir=Path(tmp) / "run",
                    node=f"warm-{secrets.token_hex(4)}",
                )
                stop, ready = asyncio.Event(), asyncio.Event()
                service = asyncio.create_task(run_env(config, stop=stop, ready=ready))
                waiter = asyncio.create_task(ready.wait())
                done, _ = await asyncio.wait(
                    {service, waiter}, timeout=60, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                if service in done:
                    service.result()
                if not ready.is_set():
                    raise SandboxError("the environment service did not become ready in 60 s")
                client = EnvClient(nc, timeout=60)
                try:
                    return await fn(client)
                finally:
                    with contextlib.suppress(Exception):
                        for sb in (await client.list()).sandboxes:
                            with contextlib.suppress(Exception):
                                await client.destroy(sb.id)
                    stop.set()
                    await asyncio.wait_for(service, 60)
            finally:
                await nc.close()
        finally:
            server.stop()
