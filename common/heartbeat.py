"""Heartbeat files: the main worker refreshes the file's mtime every scheduling-loop turn and
records who it is in the file's content; the shadow reads both to decide whether the main
worker is alive, dead or hung. The decision (``assess``) is pure and unit-tested. Beside it, the
liveness of a pid: ``PidWatch`` (a pidfd, for a process one watches) and ``process_alive`` (one
look at ``/proc``, for any pid) and ``process_exiting`` (the same look, which also counts a
process that has begun to exit)."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Identity:
    """Who owns the heartbeat file."""

    pid: int
    epoch: int
    engine_id: str


def write_identity(path: Path, identity: Identity) -> None:
    """Atomically record the owner (the mtime is refreshed separately, every loop turn)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{identity.pid}.tmp")
    tmp.write_text(
        json.dumps({"pid": identity.pid, "epoch": identity.epoch, "engine_id": identity.engine_id})
    )
    os.replace(tmp, path)


def read_identity(path: Path) -> tuple[Identity, float] | None:
    """(owner, mtime) of a heartbeat file, or None if absent or unreadable."""
    try:
        st = path.stat()
        return _parse(path, st.st_ino, st.st_size), st.st_mtime
    except (OSError, ValueError, KeyError):
        return None


_cache: dict[tuple[Path, int, int], Identity] = {}


def _parse(path: Path, inode: int, size: int) -> Identity:
    """The identity in a heartbeat file, parsed once per file version: ``write_identity``
    replaces the file (a new inode) while the loop only touches its mtime, so a watcher's
    steady state is one ``stat`` per check."""
    key = (path, inode, size)
    ident = _cache.get(key)
    if ident is None:
        data = json.loads(path.read_text())
        ident = Identity(int(data["pid"]), int(data["epoch"]), str(data["engine_id"]))
        _cache.clear()
        _cache[key] = ident
    return ident


class Verdict(enum.Enum):
    WAITING = "waiting"
    """No main worker has claimed the engine yet (or it is inside its start-up grace)."""
    ALIVE = "alive"
    DEAD = "dead"
    """The process is gone."""
    HUNG = "hung"
    """The process exists but its loop stopped turning (SIGSTOP, deadlock, stuck kernel)."""


def assess(*, pid_alive: bool | None, age_s: float | None, stale_after_s: float) -> Verdict:
    """Judge the main worker from its liveness and the heartbeat's age.

    ``pid_alive`` None / ``age_s`` None mean no identity / no heartbeat yet: keep waiting (the
    grace period of a slow-starting worker is simply that the watch has not armed yet)."""
    if pid_alive is None or age_s is None:
        return Verdict.WAITING
    if not pid_alive:
        return Verdict.DEAD
    if age_s > stale_after_s:
        return Verdict.HUNG
    return Verdict.ALIVE


def _stat_fields(pid: int | None) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); None when
    ``pid`` is not a process (None, 0, negative, or no such entry)."""
    if not pid or pid < 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[-1].split()
    except OSError:
        return None


_DEAD_STATES = (b"Z", b"X", b"x")


def process_alive(pid: int | None) -> bool:
    """``pid`` runs: it exists and is neither a zombie nor dead (``/proc/<pid>/stat``). None, 0
    and negative pids are not processes."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in _DEAD_STATES


PF_EXITING = 0x4
"""The kernel's per-task flag (``/proc/<pid>/stat`` field 9) set when a task begins to exit."""


def process_exiting(pid: int | None) -> bool:
    """``pid`` has begun to exit, or is gone: the kernel set ``PF_EXITING``, or it is a zombie,
    dead or absent. A SIGKILLed container init still reads as sleeping or running for some tens
    of milliseconds (it waits for its children) after its cgroup is gone; its ``PF_EXITING``
    is set first (measured on real containers), so this tells that death at once where
    ``process_alive`` would still say alive."""
    fields = _stat_fields(pid)
    return fields is None or fields[0] in _DEAD_STATES or bool(int(fields[6]) & PF_EXITING)


class PidWatch:
    """Liveness of one pid through a pidfd: exact even while the process is an unreaped zombie,
    and immune to pid reuse."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self.fd = None

    def alive(self) -> bool:
        if self.fd is None:
            return False
        import select

        ready, _, _ = select.select([self.fd], [], [], 0)
        return not ready  # a pidfd turns readable when the process exits

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
