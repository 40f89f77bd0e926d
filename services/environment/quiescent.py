"""Is a frozen sandbox's state, apart from its files, exactly a fresh container's?

A sandbox whose only processes are its init (PID 1, ``docker_ops.INIT_COMMAND``) and init's
``sleep``, whose ``/dev`` is as Docker made it, whose ``/dev/shm`` and ``/dev/mqueue`` are empty
and whose IPC namespace holds no System V object has no runtime state R_k beyond what a fresh
container of its image has. Its checkpoint is then its writable layer alone (method ``layer``):
CRIU would dump init and ``sleep``, which a fresh container re-creates identically, at ~10× the
CPU. A restore starts a fresh container from the image with the layer installed.

Everything here is read from the host (``/proc``, the cgroup's task list, the container's root
through ``/proc/<pid>/root``) while the container is frozen, so nothing can change under the
check. Any doubt (an unreadable file, an unknown baseline, IPC tables readable neither through
``setns`` nor by ``nsenter``) answers "not quiescent" and the checkpoint uses CRIU."""

from __future__ import annotations

import asyncio
import ctypes
import os
import stat
import threading
from pathlib import Path

from common.errors import BelayerError
from services.environment import criu_ops as ops
from services.environment.docker_ops import INIT_SLEEP

DevSignature = tuple[tuple[str, int, int, int, int, int, str], ...]
"""``/dev`` as (path, mode, rdev, size, uid, gid, symlink target) of every entry, sorted."""

SKIPPED = ("pts", "shm", "mqueue")
"""``/dev`` entries not in the signature: ``pts`` (a pty lives only as long as a process holds
it) and the two checked for emptiness instead."""

MAX_DEV_ENTRIES = 1024
"""A ``/dev`` with more entries than this is not compared (not quiescent): the walk runs while
the sandbox is frozen and must stay short whatever the agent put there."""

SYSV = ("shm", "sem", "msg")
"""``/proc/sysvipc`` tables (each a header line, then one line per object)."""
SYSV_PATHS = tuple(f"/proc/sysvipc/{t}" for t in SYSV)


def task_ids(control: Path) -> set[int] | None:
    """Every thread id in the container's cgroup (the freezer's, or the v2 cgroup's)."""
    name = "tasks" if control.name == "freezer.state" else "cgroup.threads"
    try:
        return {int(t) for t in (control.parent / name).read_text().split()}
    except (OSError, ValueError):
        return None


def _ppid_argv(tid: int) -> tuple[int, tuple[str, ...]] | None:
    try:
        fields = Path(f"/proc/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        raw = Path(f"/proc/{tid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return None
    argv = tuple(a.decode(errors="replace") for a in raw.split(b"\0")[:-1])
    return int(fields[1]), argv


def process_reason(init_pid: int, tids: set[int] | None) -> str | None:
    """``None`` when the tasks are init and at most init's ``sleep``; else why not."""
    if tids is None:
        return "the cgroup's tasks are unreadable"
    if init_pid not in tids:
        return "init is not in the container's cgroup"
    others = tids - {init_pid}
    if len(others) > 1:
        return f"{len(others)} tasks besides init"
    for tid in others:
        info = _ppid_argv(tid)
        if info is None or info != (init_pid, INIT_SLEEP):
            return "a process besides init's sleep"
    return None


def _raise(exc: OSError) -> None:
    raise exc


def dev_signature(init_pid: int) -> DevSignature | None:
    """The container's ``/dev`` (seen through its init's root), ``None`` when unreadable."""
    root = f"/proc/{init_pid}/root/dev"
    out: list[tuple[str, int, int, int, int, int, str]] = []
    try:
        for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):
            rel_dir = os.path.relpath(dirpath, root)
            if rel_dir == ".":
                dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED)
                filenames = [f for f in filenames if f not in SKIPPED]
            for name in [*dirnames, *filenames]:
                if len(out) >= MAX_DEV_ENTRIES:
                    return None
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
                size = st.st_size if stat.S_ISREG(st.st_mode) else 0
                out.append(
                    (
                        os.path.normpath(os.path.join(rel_dir, name)),
                        st.st_mode,
                        st.st_rdev,
                        size,
                        st.st_uid,
                        st.st_gid,
                        target,
                    )
                )
    except OSError:
        return None
    return tuple(sorted(out))


def dev_reason(init_pid: int, baseline: DevSignature | None) -> str | None:
    """``None`` when ``/dev`` matches a fresh container's and ``/dev/shm``, ``/dev/mqueue``
    are empty; else why not."""
    if baseline is None:
        return "no fresh-container /dev to compare with"
    if dev_signature(init_pid) != baseline:
        return "/dev differs from a fresh container's"
    for name in ("shm", "mqueue"):
        try:
            with os.scandir(f"/proc/{init_pid}/root/dev/{name}") as entries:
                if next(entries, None) is not None:
                    return f"/dev/{name} is not empty"
        except OSError:
            return f"/dev/{name} is unreadable"
    return None


_CLONE_NEWIPC = 0x08000000


def _sysvipc_tables(init_pid: int) -> str:
    """``/proc/sysvipc/*`` as seen in ``init_pid``'s IPC namespace, read by a thread of its own
    that joins the namespace (``setns`` moves only the calling thread) and then ends, so no
    thread of the service is left in a sandbox's namespace. Raises ``OSError``."""
    out: list[str] = []
    errors: list[OSError] = []

    def read() -> None:
        try:
            fd = os.open(f"/proc/{init_pid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if ops.LIBC.setns(fd, _CLONE_NEWIPC) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns: {os.strerror(err)}")
            finally:
                os.close(fd)
            out.extend(Path(p).read_text() for p in SYSV_PATHS)
        except OSError as exc:
            errors.append(exc)

    reader = threading.Thread(target=read, name="sysvipc-reader", daemon=True)
    reader.start()
    reader.join()
    if errors or len(out) != len(SYSV):
        raise errors[0] if errors else OSError("the System V IPC tables were not read")
    return "".join(out)


async def ipc_reason(init_pid: int) -> str | None:
    """``None`` when the container's IPC namespace holds no System V object (``/proc/sysvipc``
    shows the reader's namespace: read from a thread in the container's, else — ``setns``
    refused — by ``nsenter``)."""
    try:
        text = await asyncio.to_thread(_sysvipc_tables, init_pid)
    except OSError:
        try:
            text = await ops.run(
                ["nsenter", "-t", str(init_pid), "-i", "cat", *SYSV_PATHS],
                timeout=10.0,
                what="read the sandbox's System V IPC",
            )
        except (BelayerError, OSError):
            return "its System V IPC is unreadable"
    if len(text.strip().splitlines()) > len(SYSV):  # more than the three header lines
        return "System V IPC objects exist"
    return None


async def reason(control: Path, init_pid: int, baseline: DevSignature | None) -> str | None:
    """``None`` when the frozen sandbox is quiescent (see the module); else the first reason
    it is not."""
    why = process_reason(init_pid, task_ids(control)) or dev_reason(init_pid, baseline)
    return why or await ipc_reason(init_pid)
