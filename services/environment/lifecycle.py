"""Start-up and stop of the sandbox manager.

Ownership is the run directory's: every sandbox container carries ``belayer.run=<run key>``
(``EnvConfig.run_key``, a hash of the resolved run directory, the same in every run), so a
restarted service — or the next ``belayer up`` of the same run directory, whatever its node
label — finds what earlier runs left: it adopts the sandboxes it has records of and reaps
every other container and checkpoint directory of the run directory.

A graceful stop destroys every sandbox (they do not outlive their node) unless the run
directory holds the keep marker (``belayer down --keep-sandboxes``): then the sandboxes stay,
with their records, for the next start to adopt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from common.errors import BelayerError, SandboxError
from common.logging import get_logger
from services.environment import core, snapshot
from services.environment import criu_ops as ops
from services.environment.core import SandboxState
from services.environment.ports import Fleet

log = get_logger(component="env.lifecycle")


async def adopt(fleet: Fleet) -> None:
    """Kill the CRIU dumps a killed service left running (``criu_ops.kill_orphan_dumps``),
    re-adopt persisted sandboxes (a killed service's, or those a ``belayer down
    --keep-sandboxes`` kept), thaw containers a killed service left frozen (not those Docker
    paused), delete partial checkpoint directories, and reap the containers and checkpoint
    directories of this run directory that no sandbox owns."""
    config = fleet.config
    config.checkpoint_root.mkdir(parents=True, exist_ok=True)
    for pid in await asyncio.to_thread(ops.kill_orphan_dumps, config.checkpoint_root):
        log.warning("orphan_criu_killed", pid=pid)
    for tmp in config.checkpoint_root.glob(f"*/{core.TMP_PREFIX}*"):
        log.warning("partial_checkpoint_removed", path=str(tmp))
        ops.remove_tree(tmp)
    for rec in core.load_records(config.records_dir):
        fleet.records[rec.id] = rec
        fleet.locks[rec.id] = asyncio.Lock()
    await reap(fleet)
    for rec in fleet.records.values():
        rec.state = SandboxState.RUNNING.value
        if not await fleet.running(rec):
            rec.state = SandboxState.FAILED.value
        else:
            state = (await asyncio.to_thread(fleet.docker.inspect, rec.container_id))["State"]
            control = ops.freezer_path(int(state["Pid"]))
            if control is not None and ops.is_frozen(control) and not state.get("Paused"):
                ops.thaw(control)
                log.warning("frozen_container_thawed", sandbox_id=rec.id)
        ptr, _ = await fleet.store.get(rec.id)
        rec.ready_prefix = ptr.prefix if ptr else None
        rec.checkpoint_id = ptr.checkpoint_id if ptr else None
        fleet.save(rec)
    if config.keep_marker.exists():
        log.info("kept_sandboxes_adopted", sandboxes=len(fleet.records))
        config.keep_marker.unlink(missing_ok=True)


async def reap(fleet: Fleet) -> None:
    """Remove the containers of this run directory (or node) and the checkpoint directories no
    sandbox record owns: what earlier runs, killed services or interrupted restores left."""
    owned = {r.container_id for r in fleet.records.values()}
    for cid, sid in await asyncio.to_thread(fleet.docker.labelled):
        if cid not in owned:
            log.info("orphan_container_reaped", container_id=cid[:12], sandbox_id=sid)
            await asyncio.to_thread(fleet.docker.remove, cid)
            snapshot.clear_markers(fleet.config, cid)
    reap_dirs(fleet)


def reap_dirs(fleet: Fleet) -> None:
    """Remove the checkpoint directories of sandboxes that have no record."""
    root = fleet.config.checkpoint_root
    for d in list(root.iterdir()) if root.is_dir() else []:
        if d.name not in fleet.records:
            log.info("orphan_checkpoints_reaped", sandbox_id=d.name)
            ops.remove_tree(d)


async def close(fleet: Fleet) -> None:
    """Graceful stop (after the server stopped taking requests): wait, bounded by one
    ``lock_wait_s`` in all, for in-flight operations, then destroy every sandbox and reap
    whatever else of this run directory is left — a stopped service leaves no container and no
    checkpoint directory behind (sandboxes do not outlive their node). With the keep marker
    (``belayer down --keep-sandboxes``) the sandboxes stay for the next start instead."""
    deadline = time.monotonic() + fleet.config.lock_wait_s
    for lock in list(fleet.locks.values()):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lock.acquire(), max(0.0, deadline - time.monotonic()))
            lock.release()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(fleet.settle(), max(1.0, deadline - time.monotonic()))
    if fleet.config.keep_marker.exists():
        for rec in fleet.records.values():
            if rec.status in (SandboxState.CHECKPOINTING, SandboxState.RESTORING):
                rec.move(SandboxState.FAILED)
                fleet.save(rec)
        log.info("sandboxes_kept", sandboxes=len(fleet.records))
        return
    await destroy_all(fleet)


async def destroy_all(fleet: Fleet) -> int:
    """Destroy every sandbox (a busy one too: its operation is abandoned), then remove this run
    directory's labelled containers and the checkpoint directories no sandbox owns. Returns how
    many sandboxes were destroyed; a failure (dockerd unreachable) is logged and leaves the
    failed sandbox's record for the next start to adopt."""
    destroyed = 0
    for rec in list(fleet.records.values()):
        if rec.status in (SandboxState.CHECKPOINTING, SandboxState.RESTORING):
            rec.move(SandboxState.FAILED)  # its operation ran past the drain and is dropped
        try:
            await fleet.remove(rec)
        except BelayerError as exc:
            log.warning("sandbox_destroy_failed", sandbox_id=rec.id, error=str(exc))
            continue
        fleet.locks.pop(rec.id, None)
        destroyed += 1
        log.info("sandbox_destroyed", sandbox_id=rec.id, reason="shutdown")
    try:
        await reap(fleet)
    except SandboxError as exc:
        log.warning("orphan_reap_failed", error=str(exc))
        reap_dirs(fleet)
    return destroyed
