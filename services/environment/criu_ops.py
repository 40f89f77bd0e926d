"""Host-side checkpoint mechanics: freezing a Docker container's cgroup, archiving and
installing its overlay upper dir, dumping its processes with CRIU through runc, and making
files durable. Every child process dies with the service (PR_SET_PDEATHSIG) and runs under a
timeout in a session of its own, whose whole process group is killed at the timeout or when the
call is cancelled: ``runc checkpoint`` runs CRIU as its own child, and a CRIU orphaned by a
killed ``runc`` keeps the container's processes seized (under ptrace) for good — Docker then
cannot kill or remove the container. The death signal reaches ``runc`` only, so a CRIU orphaned
by a killed *service* is killed by the restarted service (:func:`kill_orphan_dumps`).

The death signal is set by util-linux's ``setpriv --pdeathsig`` in front of the command where it
is installed: Python then spawns with ``vfork`` (no ``preexec_fn``), ~2.5 ms of CPU less a
child (measured) than a ``fork`` of the service that runs ``prctl`` in Python between fork and
exec, and the event loop waits for the child's exec ~0.5 ms instead of ~2.4 ms.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import shutil
import signal
import time
from pathlib import Path

from common.errors import SandboxError, Timeout

LIBC = ctypes.CDLL(None, use_errno=True)
"""The C library (``prctl`` here, ``setns`` for ``quiescent``), errno kept."""
_PR_SET_PDEATHSIG = 1
TAR_CREATE = ["--xattrs", "--xattrs-include=trusted.*", "--numeric-owner", "--sparse"]
# Only overlay metadata (whiteouts, opaque dirs) and user xattrs are installed back.
TAR_EXTRACT = [
    "--xattrs",
    "--xattrs-include=trusted.overlay.*",
    "--xattrs-include=user.*",
    "--numeric-owner",
    "--same-permissions",
    "--no-overwrite-dir",
]


PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The search path of every child (the service's own environment is not passed on)."""
SETPRIV = shutil.which("setpriv", path=PATH)
"""util-linux ``setpriv`` (sets the death signal, then execs the command), or None."""


def _die_with_parent() -> None:
    LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


async def run(argv: list[str], *, timeout: float, what: str, **ctx: object) -> str:
    """Run ``argv``; return stdout; raise ``Timeout``/``SandboxError`` (with stderr's tail)."""
    if SETPRIV:
        spawn, preexec = [SETPRIV, "--pdeathsig", "KILL", "--", *argv], None
    else:
        spawn, preexec = argv, _die_with_parent
    try:
        proc = await asyncio.create_subprocess_exec(
            *spawn,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=preexec,
            env={"PATH": PATH},
            start_new_session=True,
        )
    except OSError as exc:
        raise SandboxError(f"{what}: cannot run {argv[0]}: {exc}", **ctx) from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (TimeoutError, asyncio.CancelledError):
        kill_group(proc.pid)
        await proc.wait()
        if isinstance(asyncio.current_task(), asyncio.Task) and asyncio.current_task().cancelling():  # type: ignore[union-attr]  # checked just before
            raise
        raise Timeout(f"{what} ran past its deadline", timeout_s=round(timeout, 3), **ctx) from None
    if proc.returncode != 0:
        tail = (err or out).decode(errors="replace").strip()[-800:]
        raise SandboxError(f"{what} failed (exit {proc.returncode}): {tail}", **ctx)
    return out.decode(errors="replace")


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (a child of :func:`run`, and what it started:
    CRIU under ``runc checkpoint``)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def is_orphan_dump(comm: str, ppid: int, cwd: str, checkpoint_root: Path) -> bool:
    """Whether a process (its ``comm``, parent and working directory) is a CRIU of this
    service's checkpoints left without its ``runc``: reparented to init, working in a
    checkpoint's work directory under ``checkpoint_root`` (possibly deleted since)."""
    cwd = cwd.removesuffix(" (deleted)")
    return comm == "criu" and ppid == 1 and cwd.startswith(f"{checkpoint_root}/")


def kill_orphan_dumps(checkpoint_root: Path, proc: Path = Path("/proc")) -> list[int]:
    """SIGKILL every orphaned CRIU of ``checkpoint_root`` (:func:`is_orphan_dump`) — a killed
    service's ``runc checkpoint`` died with it, its CRIU did not; its tracees (the container's
    processes) are released when it dies. Returns the pids killed."""
    roots = {checkpoint_root, checkpoint_root.resolve()}
    killed = []
    for d in proc.glob("[0-9]*"):
        try:
            comm = (d / "comm").read_text().strip()
            if comm != "criu":
                continue
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cwd = os.readlink(d / "cwd")
        except (OSError, ValueError, IndexError):
            continue  # gone while we looked
        if any(is_orphan_dump(comm, ppid, cwd, root) for root in roots):
            try:
                os.kill(int(d.name), signal.SIGKILL)
                killed.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                pass
    return killed


# --- freezing ---------------------------------------------------------------------------------
def freezer_path(init_pid: int) -> Path | None:
    """The container's freezer control file (cgroup v1 ``freezer.state`` or v2 ``cgroup.freeze``)."""
    try:
        lines = Path(f"/proc/{init_pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            f = Path("/sys/fs/cgroup/freezer") / path.lstrip("/") / "freezer.state"
            return f if f.exists() else None
    for line in lines:
        if line.startswith("0::"):
            f = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "cgroup.freeze"
            return f if f.exists() else None
    return None


CGROUP_ROOT = Path("/sys/fs/cgroup")


def container_freezer(container_id: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The freezer control file of a Docker container found by its id alone, without asking
    Docker (whose inspect can hang on a wedged container): cgroup v1 or v2, with the
    ``cgroupfs`` (``docker/<id>``) or ``systemd`` (``system.slice/docker-<id>.scope``) driver."""
    for rel in (f"docker/{container_id}", f"system.slice/docker-{container_id}.scope"):
        for control in (root / "freezer" / rel / "freezer.state", root / rel / "cgroup.freeze"):
            if control.exists():
                return control
    return None


async def freeze(control: Path, timeout: float = 5.0) -> None:
    """Freeze every task of the cgroup and wait until the kernel reports it frozen."""
    v1 = control.name == "freezer.state"
    # cgroup control files are kernel memory: reading/writing them never blocks on I/O.
    control.write_text("FROZEN" if v1 else "1")  # noqa: ASYNC240  (a cgroup file: no disk I/O)
    end = time.monotonic() + timeout
    while True:
        if v1:
            done = control.read_text().strip() == "FROZEN"  # noqa: ASYNC240  (a cgroup file)
        else:
            done = "frozen 1" in (control.parent / "cgroup.events").read_text()
        if done:
            return
        if time.monotonic() > end:
            thaw(control)
            raise Timeout("container did not freeze in time", timeout_s=timeout)
        await asyncio.sleep(0.002)


def thaw(control: Path) -> None:
    try:
        control.write_text("THAWED" if control.name == "freezer.state" else "0")
    except OSError:
        pass


def is_frozen(control: Path) -> bool:
    try:
        text = control.read_text().strip()
    except OSError:
        return False
    return text in ("FROZEN", "FREEZING", "1")


# --- the writable layer -----------------------------------------------------------------------
async def archive_layer(upper: str, dest: Path, *, timeout: float) -> int:
    """tar the upper dir (whiteouts = 0:0 char devices and ``trusted.overlay.*`` xattrs kept)."""
    await run(
        ["tar", "-C", upper, *TAR_CREATE, "-cf", str(dest), "."],
        timeout=timeout,
        what="archive writable layer",
    )
    return dest.stat().st_size  # noqa: ASYNC240  (one stat of a file we just wrote)


async def install_layer(archive: Path, upper: str, *, timeout: float) -> None:
    """Untar a *validated* archive into a fresh container's (empty) upper dir."""
    await run(
        ["tar", "-C", upper, *TAR_EXTRACT, "-xf", str(archive)],
        timeout=timeout,
        what="install writable layer",
    )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# --- CRIU through runc ------------------------------------------------------------------------
async def runc_checkpoint(
    runc: str, root: Path, container_id: str, images: Path, work: Path, *, timeout: float
) -> None:
    """Dump the container's process tree with CRIU (via runc), leaving it running (it stays
    frozen if it was frozen: runc/CRIU restore the freezer state they found)."""
    await run(
        [
            runc,
            "--root",
            str(root),
            "checkpoint",
            "--image-path",
            str(images),
            "--work-path",
            str(work),
            "--leave-running",
            container_id,
        ],
        timeout=timeout,
        what="criu dump (runc checkpoint)",
        container_id=container_id[:12],
    )


def runc_knows(root: Path, container_id: str) -> bool:
    return (root / container_id / "state.json").exists()


def criu_errors(log: Path, limit: int = 3) -> str:
    """The last ``limit`` ``Error (…)`` lines of a CRIU log, joined (empty if none/unreadable)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (1 << 20)))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line.split(") ", 1)[-1].strip() for line in lines if "Error (" in line]
    return " | ".join(errors[-limit:])[:1000]


# --- files ------------------------------------------------------------------------------------
def dir_files(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}


def dir_digests(directory: Path) -> dict[str, str]:
    """File name → SHA-256 of every plain file directly in ``directory`` (none if absent)."""
    if not directory.is_dir():
        return {}
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()}


def fsync_tree(directory: Path, *, skip_pages: bool = False) -> None:
    """fsync every file and directory below ``directory`` (and itself); ``skip_pages`` leaves
    CRIU's memory page images (``pages-*.img``, the bulk of a dump) to normal writeback."""
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if skip_pages and name.startswith("pages-") and name.endswith(".img"):
                continue
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_or_copy_tree(src: Path, dst: Path) -> None:
    """Hard-link (same file system) or copy every file of ``src`` into a new ``dst``."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if not p.is_file():
            continue
        try:
            os.link(p, dst / p.name)
        except OSError:
            shutil.copy2(p, dst / p.name)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
