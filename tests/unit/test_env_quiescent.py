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
