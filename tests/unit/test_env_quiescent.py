"""The quiescence test of a sandbox (``services.environment.quiescent``), on real processes of
this machine: which task sets count as "init and its sleep only"."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.environment import quiescent
from services.environment.docker_ops import INIT_SLEEP


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A real child of this process running the sandbox init's sleep."""
    proc = subprocess.Popen(list(INIT_SLEEP))
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_init_alone_or_with_its_sleep_is_quiescent(child: subprocess.Popen[bytes]) -> None:
    me = os.getpid()
    assert quiescent.process_reason(me, {me}) is None
    assert quiescent.process_reason(me, {me, child.pid}) is None


def test_any_other_task_is_runtime_state(child: subprocess.Popen[bytes]) -> None:
    me = os.getpid()
    assert quiescent.process_reason(me, None) == "the cgroup's tasks are unreadable"
    assert quiescent.process_reason(me, {child.pid}) == "init is not in the container's cgroup"
    other = subprocess.Popen(["sleep", "999"])  # same parent, other argv
    try:
        assert quiescent.process_reason(me, {me, other.pid}) == "a process besides init's sleep"
        assert quiescent.process_reason(me, {me, child.pid, other.pid}) == "2 tasks besides init"
    finally:
        other.kill()
        other.wait()
    # the right argv, but not init's child: pid 1 of this machine is not its parent
    assert quiescent.process_reason(1, {1, child.pid}) == "a process besides init's sleep"


def test_task_ids_reads_the_cgroup_task_list(tmp_path: Path) -> None:
    v1 = tmp_path / "freezer.state"
    (tmp_path / "tasks").write_text("12\n34\n")
    assert quiescent.task_ids(v1) == {12, 34}
    v2 = tmp_path / "cgroup.freeze"
    (tmp_path / "cgroup.threads").write_text("56\n")
    assert quiescent.task_ids(v2) == {56}
    (tmp_path / "tasks").write_text("12\nnot-a-pid\n")
    assert quiescent.task_ids(v1) is None
    assert quiescent.task_ids(tmp_path / "missing" / "freezer.state") is None


def test_an_unknown_baseline_is_never_quiescent() -> None:
    assert quiescent.dev_reason(os.getpid(), None) == "no fresh-container /dev to compare with"


def test_dev_signature_sees_entries_and_their_kind() -> None:
    sig = quiescent.dev_signature(os.getpid())
    assert sig is not None
    names = {entry[0] for entry in sig}
    assert "null" in names and "shm" not in names and "pts" not in names
    assert quiescent.dev_signature(2**22 + 12345) is None  # no such process


def test_a_huge_dev_is_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk is bounded: past ``MAX_DEV_ENTRIES`` the answer is "unreadable" (a CRIU dump)."""
    full = quiescent.dev_signature(os.getpid())
    assert full is not None and len(full) > 2
    monkeypatch.setattr(quiescent, "MAX_DEV_ENTRIES", len(full) - 1)
    assert quiescent.dev_signature(os.getpid()) is None
    monkeypatch.setattr(quiescent, "MAX_DEV_ENTRIES", len(full))
    assert quiescent.dev_signature(os.getpid()) == full


SHMGET = "import ctypes; assert ctypes.CDLL(None).shmget(4321, 4096, 0o1666) >= 0"


@pytest.fixture
def ipc_namespaces() -> Iterator[tuple[int, int]]:
    """Two processes in IPC namespaces of their own: (empty one, one holding a SysV segment).
    Each says "ready" once its namespace (and segment) exists."""
    procs = [
        subprocess.Popen(
            ["unshare", "--ipc", "sh", "-c", f"{setup}echo ready && exec sleep 999"],
            stdout=subprocess.PIPE,
        )
        for setup in ("", f'python3 -c "{SHMGET}" && ')
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        yield procs[0].pid, procs[1].pid
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


async def test_sysv_objects_are_read_in_the_sandboxes_namespace(
    ipc_namespaces: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread joins the process's IPC namespace (this process's stays as it was); the
    ``nsenter`` fallback, where ``setns`` is refused, gives the same answers."""
    empty, holder = ipc_namespaces
    mine = os.readlink("/proc/self/ns/ipc")
    assert "4321" in quiescent._sysvipc_tables(holder)
    assert "4321" not in quiescent._sysvipc_tables(empty)
    assert (
        os.readlink("/proc/self/ns/ipc") == mine and os.readlink("/proc/thread-self/ns/ipc") == mine
    )
    assert await quiescent.ipc_reason(empty) is None
    assert await quiescent.ipc_reason(holder) == "System V IPC objects exist"
    assert await quiescent.ipc_reason(2**22 + 12345) == "its System V IPC is unreadable"

    def refused(pid: int) -> str:
        raise OSError(1, "setns: Operation not permitted")

    monkeypatch.setattr(quiescent, "_sysvipc_tables", refused)
    assert await quiescent.ipc_reason(empty) is None
    assert await quiescent.ipc_reason(holder) == "System V IPC objects exist"
