"""The environment service's children (``criu_ops.run``) die with it: each starts with
SIGKILL as its parent-death signal, whether ``setpriv`` sets it (the fast spawn) or, where
``setpriv`` is missing, a ``prctl`` between fork and exec."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.errors import SandboxError, Timeout
from services.environment import criu_ops as ops

PDEATHSIG = (
    "import ctypes; s = ctypes.c_int(); "
    "assert ctypes.CDLL(None).prctl(2, ctypes.byref(s)) == 0; print(s.value)"  # PR_GET_PDEATHSIG
)


@pytest.mark.parametrize("setpriv", [True, False], ids=["setpriv", "prctl"])
async def test_children_get_sigkill_as_death_signal(
    setpriv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if setpriv:
        assert ops.SETPRIV, "util-linux setpriv is part of the base system here"
    else:
        monkeypatch.setattr(ops, "SETPRIV", None)
    out = await ops.run([sys.executable, "-c", PDEATHSIG], timeout=30.0, what="probe")
    assert out.strip() == str(int(signal.SIGKILL))


async def test_failures_and_deadlines_are_typed_errors() -> None:
    with pytest.raises(SandboxError, match=r"probe failed \(exit 3\): boom"):
        await ops.run(
            [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
            timeout=30.0,
            what="probe",
        )
    with pytest.raises(Timeout, match="probe ran past its deadline"):
        await ops.run(
            [sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.2, what="probe"
        )


async def test_a_deadline_kills_what_the_child_started_too(tmp_path: Path) -> None:
    # runc checkpoint runs CRIU as its own child; killing runc alone left CRIU running with the
    # container's processes seized (Docker could no longer kill or remove the container).
    pidfile = tmp_path / "grandchild"
    script = f"sleep 1000 & echo $! > {pidfile}; wait"
    with pytest.raises(Timeout):
        await ops.run(["sh", "-c", script], timeout=1.0, what="probe")
    grandchild = int(pidfile.read_text())
    assert _gone_or_zombie(grandchild), "the child's own child outlived the deadline"


def _gone_or_zombie(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_an_orphaned_criu_of_this_services_checkpoints_is_recognised() -> None:
    root = Path("/srv/node/env/checkpoints")
    work = f"{root}/sb-1/.tmp-sb-1-k000003-abc/work"
    assert ops.is_orphan_dump("criu", 1, work, root)
    assert ops.is_orphan_dump("criu", 1, f"{work} (deleted)", root)  # the partial dir reaped
    assert not ops.is_orphan_dump("criu", 4242, work, root)  # its runc still runs
    assert not ops.is_orphan_dump("sh", 1, work, root)
    assert not ops.is_orphan_dump("criu", 1, "/srv/other/env/checkpoints/sb-1/work", root)
    assert not ops.is_orphan_dump("criu", 1, f"{root}-x/sb-1/work", root)


def test_kill_orphan_dumps_kills_only_this_services_orphans(tmp_path: Path) -> None:
    # A real process named criu, reparented to init, working under the checkpoint root.
    root = tmp_path / "checkpoints"
    work = root / "sb-1" / "work"
    work.mkdir(parents=True)
    other = tmp_path / "elsewhere"
    other.mkdir()
    sleep = shutil.which("sleep")
    assert sleep
    criu = tmp_path / "criu"  # comm is the executable's name
    criu.symlink_to(sleep)
    pids = []
    for cwd in (work, other):
        out = subprocess.run(
            ["sh", "-c", f"cd {cwd} && {criu} 1000 >/dev/null 2>&1 & echo $!"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        pids.append(int(out.stdout))  # sh exited: the sleep is init's (or a subreaper's) now
    ours, theirs = pids
    try:
        assert _ppid(ours) == 1, "the orphan went to a subreaper, not init"
        assert ops.kill_orphan_dumps(root) == [ours]
        assert _wait_gone(ours)
        assert not _gone_or_zombie(theirs)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait_gone(pid: int) -> bool:
    for _ in range(200):
        if _gone_or_zombie(pid):
            return True
        time.sleep(0.01)
    return False
