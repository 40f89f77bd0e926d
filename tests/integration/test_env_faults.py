"""Unlucky fault sequences on real dockerd + CRIU: checkpoints that pass validation but fail
inside CRIU (quarantined, never lose the last good state), paused sandboxes, containers that
die during a checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import docker.errors
import pytest

from common.errors import BelayerError, Conflict, SandboxError
from common.heartbeat import process_alive
from schemas.env import EnvRestored, SandboxLimits
from services.environment import criu_ops as ops
from services.environment import snapshot
from services.environment.client import EnvClient
from services.environment.core import Limits, SandboxRecord, SandboxState
from services.environment.docker_ops import DockerOps
from services.environment.snapshot import Progress
from tests.integration.env_helpers import (
    BIG_PROCESS,
    BUMP,
    COUNTER,
    START_COUNTER,
    EnvHarness,
    require_docker,
    running_env,
)

pytestmark = [pytest.mark.docker]


async def _info(c: EnvClient, sid: str):
    (sb,) = [s for s in (await c.list()).sandboxes if s.id == sid]
    return sb


def _break_in_criu(env: EnvHarness, sid: str, checkpoint_id: str) -> None:
    """Make a checkpoint that passes every validation (sizes, checksums, archive) and fails
    inside CRIU: its inventory image keeps its size, its bytes are garbage."""
    inventory = env.config.checkpoint_root / sid / checkpoint_id / "criu" / "inventory.img"
    inventory.write_bytes(b"\xff" * inventory.stat().st_size)


def _outcomes(r: EnvRestored) -> list[tuple[str, str]]:
    return [(a.checkpoint_id, a.outcome) for a in r.candidates]


@pytest.mark.timeout(300)
async def test_failed_restores_are_quarantined_and_never_lose_the_last_good_state(
    nc, nats_server, tmp_path: Path
) -> None:
    async with running_env(nc, nats_server.url, tmp_path, keep_checkpoints=2) as env:
        c, dk = env.client, require_docker()
        sid = (await c.create(files={"/root/counter.py": COUNTER})).sandbox_id
        assert (await c.exec(sid, START_COUNTER)).exit_code == 0
        assert (await c.exec(sid, BUMP)).stdout.strip() == "1"
        k1 = (await c.checkpoint(sid, 1)).checkpoint_id
        assert (await c.exec(sid, BUMP)).stdout.strip() == "2"
        k2 = (await c.checkpoint(sid, 2)).checkpoint_id
        _break_in_criu(env, sid, k2)

        dk.api.kill((await _info(c, sid)).container_id)
        r = await c.restore(sid)
        assert (r.checkpoint_id, r.fallback_from) == (k1, k2)
        assert _outcomes(r) == [(k2, "quarantined"), (k1, "restored")]
        assert "criu" in r.candidates[0].error.lower()
        assert (await _info(c, sid)).checkpoints == 1  # the quarantined one does not count
        assert (await c.exec(sid, BUMP)).stdout.strip() == "2"  # the state of k1

        # a newer checkpoint that is bad too: pruning (keep 2) must not take k1 …
        k3 = (await c.checkpoint(sid, 3)).checkpoint_id
        _break_in_criu(env, sid, k3)
        assert (env.config.checkpoint_root / sid / k1).is_dir()
        dk.api.kill((await _info(c, sid)).container_id)
        r = await c.restore(sid)
        # … and k2 is not tried again
        assert _outcomes(r) == [(k3, "quarantined"), (k1, "restored")]
        assert (await c.exec(sid, BUMP)).stdout.strip() == "2"

        # k1 restored last: two newer good checkpoints (keep 2) still leave it in place
        await c.checkpoint(sid, 4)
        k5 = (await c.checkpoint(sid, 5)).checkpoint_id
        assert (env.config.checkpoint_root / sid / k1).is_dir()
        assert (await _info(c, sid)).checkpoints == 3

        # a restore whose every candidate fails keeps the running container: nothing is lost
        before = (await _info(c, sid)).container_id
        _break_in_criu(env, sid, k5)
        with pytest.raises(BelayerError) as failed:
            await c.restore(sid, k5)
        assert failed.value.data["candidates"] == f"{k5}:quarantined"
        after = await _info(c, sid)
        assert (after.state, after.container_id) == ("running", before)
        assert (await c.exec(sid, BUMP)).stdout.strip() == "3"
        with pytest.raises(BelayerError, match="quarantined"):
            await c.restore(sid, k5)  # not retried, even on request


@pytest.mark.timeout(180)
async def test_checkpoint_of_a_paused_sandbox_keeps_it_paused_and_usable(env) -> None:
    c, dk = env.client, require_docker()
    sid = (await c.create(files={"/root/counter.py": COUNTER})).sandbox_id
    assert (await c.exec(sid, START_COUNTER)).exit_code == 0
    assert (await c.exec(sid, BUMP)).stdout.strip() == "1"
    cid = (await _info(c, sid)).container_id
    dk.api.pause(cid)
    k1 = await c.checkpoint(sid, 1)
    assert k1.prefix == 1
    assert dk.api.inspect_container(cid)["State"]["Paused"]  # still paused, as Docker says
    with pytest.raises(Conflict, match="paused"):
        await c.exec(sid, "true")
    dk.api.unpause(cid)  # refused ("not paused") when the checkpoint thawed it behind Docker
    assert (await c.exec(sid, BUMP)).stdout.strip() == "2"
    # a freeze Docker knows nothing of (a service killed mid-checkpoint) is thawed, not hung in
    control = ops.freezer_path(int(dk.api.inspect_container(cid)["State"]["Pid"]))
    assert control is not None
    await ops.freeze(control)
    assert (await c.exec(sid, "echo thawed", timeout_s=10)).stdout.strip() == "thawed"
    dk.api.kill(cid)
    r = await c.restore(sid)
    assert r.checkpoint_id == k1.checkpoint_id
    assert (await c.exec(sid, BUMP)).stdout.strip() == "2"  # the counter at k1, running


@pytest.mark.timeout(240)
async def test_container_dying_during_a_checkpoint_is_failed_not_running(env) -> None:
    c, dk = env.client, require_docker()
    sid = (await c.create(limits=SandboxLimits(memory_mb=768))).sandbox_id
    await c.exec(sid, "echo one > /root/f; " + BIG_PROCESS)
    first = await c.checkpoint(sid, 1)
    cid = (await _info(c, sid)).container_id
    pending = asyncio.create_task(c.checkpoint(sid, 2))
    base = env.config.checkpoint_root / sid
    for _ in range(4000):  # until the checkpoint is in progress (bounded)
        if any(p.name.startswith(".tmp-") for p in base.iterdir()):
            break
        await asyncio.sleep(0.002)
    else:
        raise AssertionError("checkpoint never started")
    await asyncio.to_thread(dk.api.kill, cid)
    try:
        info = await pending
    except SandboxError as exc:  # died before the dump completed: no checkpoint, says so
        assert exc.data["dump_completed"] is False
        assert "before the dump completed" in str(exc)
    else:  # the dump completed first: a ready checkpoint, and the answer says it died
        assert info.container_exited
    assert (await _info(c, sid)).state == "failed"
    with pytest.raises(SandboxError, match="dead"):
        await c.exec(sid, "true")
    r = await c.restore(sid)  # the dump of prefix 2, if complete and restorable, else prefix 1
    assert r.prefix in (1, 2) and r.candidates[-1].outcome == "restored"
    assert r.prefix == 2 or r.checkpoint_id == first.checkpoint_id
    assert (await c.exec(sid, "cat /root/f")).stdout.strip() == "one"
    assert (await _info(c, sid)).state == "running"


async def test_a_capture_in_a_killed_containers_last_moments_says_it_died(env, tmp_path) -> None:
    """The window CI once hit: a SIGKILLed container's init still reads as sleeping or running
    in /proc for some tens of ms (waiting for its children) while its freezer cgroup is
    already gone. A capture that starts then is the container's death before the dump
    (``failed``, ``dump_completed=False``), not "cannot find the container's freezer cgroup"."""
    c, dk = env.client, require_docker()
    sid = (await c.create(limits=SandboxLimits(memory_mb=768))).sandbox_id
    await c.exec(sid, BIG_PROCESS)
    cid = (await _info(c, sid)).container_id
    pid = int(dk.api.inspect_container(cid)["State"]["Pid"])
    assert ops.freezer_path(pid) is not None
    rec = SandboxRecord(
        id=sid, image=env.config.image, container_id=cid,
        limits=Limits(memory_mb=768, cpus=1.0, pids=256),
    )  # fmt: skip
    killer = threading.Thread(target=dk.api.kill, args=(cid,), daemon=True)
    killer.start()
    deadline = time.monotonic() + 60.0
    while ops.freezer_path(pid) is not None:  # until the cgroup is gone (bounded)
        assert time.monotonic() < deadline, "the killed container's cgroup never went away"
    window = process_alive(pid)  # most often True: the init is exiting, not yet a zombie
    with pytest.raises(SandboxError) as caught:
        await snapshot.capture(
            DockerOps(env.config), env.config, rec, tmp_path / "ck", "ck-1", 1, "t", Progress()
        )
    killer.join(30)
    assert caught.value.data["dump_completed"] is False, (window, str(caught.value))
    assert "before the dump completed" in str(caught.value)
    assert rec.status is SandboxState.FAILED


def _wedge(dk, cid: str, control: Path) -> threading.Thread:
    """Freeze the container's cgroup the moment an exec's ``runc init`` joins it (runc refuses
    an exec that *starts* in a frozen cgroup, so the freeze must land mid-start, as the soak's
    pause did); the exec is then stuck. Returns the thread blocked in that exec."""
    tasks = control.with_name("tasks")
    base = set(tasks.read_text().split())
    for _ in range(300):  # an exec that got through before the freeze: try again
        t = threading.Thread(
            target=lambda: dk.api.exec_start(dk.api.exec_create(cid, ["true"])["Id"]),
            daemon=True,
        )
        t.start()
        caught = False
        while t.is_alive() and not caught:
            if set(tasks.read_text().split()) - base:
                control.write_text("FROZEN")
                caught = True
        t.join(1.5)
        if t.is_alive():
            return t
        if caught:
            ops.thaw(control)
    raise AssertionError("300 execs started and none was caught mid-start")


@pytest.mark.timeout(120)
async def test_a_sandbox_wedged_by_a_pause_during_exec_start_is_destroyed(env) -> None:
    """A ``docker pause`` that lands while an exec is starting leaves the exec's ``runc init``
    stuck in the frozen cgroup, and Docker's own unpause, inspect and kill wait for it (the
    soak found it). Built here on purpose: the cgroup frozen as an exec starts, a pause queued
    behind it. Destroying the sandbox must still remove its container, and the stuck calls end."""
    c, dk = env.client, require_docker()
    sid = (await c.create()).sandbox_id
    cid = (await _info(c, sid)).container_id
    control = ops.container_freezer(cid)
    assert control is not None, f"no freezer found for container {cid[:12]}"
    stuck = await asyncio.to_thread(_wedge, dk, cid, control)

    def pause() -> None:  # refused once the container is gone: that is fine here
        with contextlib.suppress(docker.errors.APIError):
            dk.api.pause(cid)

    queued = threading.Thread(target=pause, daemon=True)
    queued.start()
    try:
        await c.destroy(sid)
        assert dk.api.containers(all=True, filters={"id": cid}) == []
        await asyncio.to_thread(stuck.join, 30)
        await asyncio.to_thread(queued.join, 30)
        assert not stuck.is_alive() and not queued.is_alive()
    finally:
        if control.exists():
            ops.thaw(control)


def _running(control: Path, argv: bytes) -> bool:
    """A task of the container's cgroup runs ``argv`` (NUL-separated, as /proc shows it)."""
    for pid in control.with_name("tasks").read_text().split():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == argv:
                return True
    return False


@pytest.mark.timeout(120)
async def test_a_pause_while_a_command_runs_is_the_sandboxs_failure_not_a_timeout(env) -> None:
    """``docker pause`` while an exec's command runs: the exec answers ``Conflict`` (state
    paused: the sandbox failed, the caller restores) instead of waiting out the command's
    timeout and reporting it as the command's own ``Timeout``."""
    c, dk = env.client, require_docker()
    sid = (await c.create()).sandbox_id
    cid = (await _info(c, sid)).container_id
    control = ops.container_freezer(cid)
    assert control is not None, f"no freezer found for container {cid[:12]}"
    call = asyncio.ensure_future(c.exec(sid, "sleep 45", timeout_s=60))
    for _ in range(400):  # the command runs (bounded wait)
        if _running(control, b"sleep\x0045\x00"):
            break
        await asyncio.sleep(0.05)
    assert _running(control, b"sleep\x0045\x00"), "the command never started"
    await asyncio.to_thread(dk.api.pause, cid)
    with pytest.raises(Conflict, match="paused") as paused:
        await call
    assert paused.value.data.get("state") == "paused"
    await c.destroy(sid)
    assert dk.api.containers(all=True, filters={"id": cid}) == []


@pytest.mark.timeout(240)
async def test_a_pause_during_a_checkpoint_is_answered_at_once_not_at_its_deadline(env) -> None:
    """``docker pause`` while a running sandbox is being checkpointed (the soak found it): runc's
    dump under the pause hung until the checkpoint's deadline, then a cooldown refused every
    checkpoint. Now the checkpoint answers at once — its checkpoint, or ``Conflict`` (paused;
    failed when the dump was cut short) — and the sandbox restores and runs. The pause is
    retried at later moments of the checkpoint until one lands while it is in flight."""
    c, dk = env.client, require_docker()
    sid = (await c.create(files={"/root/counter.py": COUNTER})).sandbox_id
    assert (await c.exec(sid, START_COUNTER)).exit_code == 0
    await c.checkpoint(sid, 1)
    base = env.config.checkpoint_root / sid
    landed = []
    for k in range(2, 40):
        cid = (await _info(c, sid)).container_id
        pending = asyncio.ensure_future(c.checkpoint(sid, k, timeout_s=30))
        for _ in range(2000):  # until the checkpoint is being written (bounded)
            if pending.done() or any(p.name.startswith(".tmp-") for p in base.iterdir()):
                break
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.01 * (k % 20))  # a later moment of the capture each time
        try:
            await asyncio.to_thread(dk.api.pause, cid)
        except docker.errors.APIError:  # refused: the checkpoint's own freeze held it
            await pending
            continue
        in_flight = not pending.done()
        try:
            await pending
            outcome = "checkpoint"
        except Conflict as exc:
            outcome = exc.data["state"]
        if in_flight:
            landed.append(outcome)
        r = await c.restore(sid)  # paused (or failed): the ready checkpoint, in a fresh container
        assert r.candidates[-1].outcome == "restored"
        assert (await c.exec(sid, BUMP, timeout_s=30)).exit_code == 0
        if len(landed) >= 3:
            break
    assert landed, "no pause landed while a checkpoint was in flight"
    assert set(landed) <= {"checkpoint", "paused", "failed"}, landed
