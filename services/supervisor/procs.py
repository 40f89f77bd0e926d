"""Child processes of the supervisor: start, watch, stop. Children die with the supervisor
(``PR_SET_PDEATHSIG``), so a killed supervisor leaves no orphans."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.supervisor.backoff import Backoff

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


@dataclass
class Child:
    """One supervised service."""

    name: str
    argv: list[str]
    log_path: Path
    restart: bool = True
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    backoff: Backoff = field(default_factory=Backoff)
    stopping: bool = False
    stop_timeout: float = 5.0
    """Seconds ``stop`` waits after SIGTERM before SIGKILL (a service's graceful drain)."""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")  # noqa: ASYNC230 - a quick local append, handed to the child
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                preexec_fn=_die_with_parent,
                close_fds=True,
            )
        finally:
            out.close()
        self.started_at = time.monotonic()

    async def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` (default ``stop_timeout``)."""
        timeout = self.stop_timeout if timeout is None else timeout
        self.stopping = True
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
