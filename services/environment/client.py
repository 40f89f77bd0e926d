"""Typed client of the environment service (used by the CLI, the benchmark, the controller)."""

from __future__ import annotations

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
        return await request(self.nc, subjects.env("create"), msg, EnvCreated, timeout=self.timeout)  # type: ignore[no-any-return]

    async def exec(self, sandbox_id: str, command: str, timeout_s: float = 30.0) -> EnvExecResult:
        msg = EnvExec(sandbox_id=sandbox_id, command=command, timeout_s=timeout_s)
        return await request(  # type: ignore[no-any-return]
            self.nc, subjects.env("exec"), msg, EnvExecResult, timeout=timeout_s + self.timeout
        )

    async def checkpoint(
        self, sandbox_id: str, prefix: int, trajectory_id: str = "", timeout_s: float = 0.0
    ) -> CheckpointInfo:
        msg = EnvCheckpoint(
            sandbox_id=sandbox_id, prefix=prefix, trajectory_id=trajectory_id, timeout_s=timeout_s
        )
        return await request(  # type: ignore[no-any-return]
            self.nc,
            subjects.env("checkpoint"),
            msg,
            CheckpointInfo,
            timeout=self.timeout + timeout_s,
        )

    async def restore(self, sandbox_id: str, checkpoint_id: str = "") -> EnvRestored:
        msg = EnvRestore(sandbox_id=sandbox_id, checkpoint_id=checkpoint_id)
        return await request(  # type: ignore[no-any-return]
            self.nc, subjects.env("restore"), msg, EnvRestored, timeout=self.timeout * 2
        )

    async def destroy(self, sandbox_id: str) -> Ok:
        return await request(  # type: ignore[no-any-return]
            self.nc,
            subjects.env("destroy"),
            EnvDestroy(sandbox_id=sandbox_id),
            Ok,
            timeout=self.timeout,
        )

    async def list(self) -> EnvListing:
        return await request(
            self.nc, subjects.env("list"), EnvList(), EnvListing, timeout=self.timeout
        )  # type: ignore[no-any-return]

    async def gc(self, trajectory_id: str) -> Ok:
        return await request(  # type: ignore[no-any-return]
            self.nc,
            subjects.env("gc"),
            EnvGc(trajectory_id=trajectory_id),
            Ok,
            timeout=self.timeout,
        )
