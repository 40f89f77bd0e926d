"""Heartbeat verdicts and pid liveness (pidfd) — the shadow's failure detector."""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

from common.heartbeat import (
    Identity,
    PidWatch,
    Verdict,
    assess,
    process_alive,
    process_exiting,
    read_identity,
    write_identity,
)
from services.supervisor.backoff import Backoff


def test_assess() -> None:
    assert assess(pid_alive=None, age_s=None, stale_after_s=2) is Verdict.WAITING
    assert assess(pid_alive=True, age_s=0.01, stale_after_s=2) is Verdict.ALIVE
    assert assess(pid_alive=True, age_s=2.5, stale_after_s=2) is Verdict.HUNG
    assert assess(pid_alive=False, age_s=0.01, stale_after_s=2) is Verdict.DEAD


def test_identity_roundtrip(tmp_path: Path) -> None:
    hb = tmp_path / "e0.hb"
    assert read_identity(hb) is None
    write_identity(hb, Identity(pid=12, epoch=3, engine_id="e0"))
    ident, mtime = read_identity(hb)  # type: ignore[misc]  # written just above: not None
    assert ident == Identity(12, 3, "e0") and mtime > 0
    hb.write_text("{not json")
    assert read_identity(hb) is None


def test_pidwatch_sees_death_of_an_unreaped_child() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    watch = PidWatch(proc.pid)
    try:
        assert watch.alive()
        proc.kill()
        # Not reaped yet: the process is a zombie, kill(pid, 0) would still succeed.
        for _ in range(1000):
            if not watch.alive():
                break
            time.sleep(0.001)  # bounded wait for the kernel to deliver SIGKILL
        assert not watch.alive()
    finally:
        watch.close()
        proc.wait()
    assert not PidWatch(proc.pid).alive()  # reaped: no such process


def test_process_alive_counts_a_zombie_as_gone() -> None:
    assert process_alive(os.getpid())
    assert not process_alive(None) and not process_alive(0) and not process_alive(-1)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert process_alive(proc.pid)
        proc.kill()
        watch = PidWatch(proc.pid)  # its pidfd turns readable once the child is a zombie
        assert watch.fd is not None
        select.select([watch.fd], [], [], 5.0)
        watch.close()
        assert not process_alive(proc.pid)  # a zombie, not yet reaped
    finally:
        proc.wait()
    assert not process_alive(proc.pid)  # reaped: no such process


def test_backoff_doubles_and_resets() -> None:
    b = Backoff(initial=0.5, maximum=4.0, stable_after=30.0)
    assert [b.next_delay(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.next_delay(60.0) == 0.5
    assert b.restarts == 6


def test_process_exiting_counts_a_zombie_and_a_gone_pid_but_not_a_live_one() -> None:
    assert not process_exiting(os.getpid())
    assert process_exiting(None) and process_exiting(0) and process_exiting(-1)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_exiting(proc.pid)
        proc.kill()
        watch = PidWatch(proc.pid)  # its pidfd turns readable once the child is a zombie
        assert watch.fd is not None
        select.select([watch.fd], [], [], 5.0)
        watch.close()
        assert process_exiting(proc.pid)  # a zombie, not yet reaped
    finally:
        proc.wait()
    assert process_exiting(proc.pid)  # reaped: no such process
