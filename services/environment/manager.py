"""The sandbox manager: create/exec/full_checkpoint/full_restore/destroy over Docker + CRIU.

Bus-agnostic: it publishes ready checkpoints through a ``ReadyStore`` (the service backs it
with a JetStream KV bucket and stream). Invariants it keeps:

* exec and checkpoint of one sandbox exclude each other (one asyncio lock per sandbox);
* a checkpoint is captured while the container's cgroup is frozen (files, then processes),
  written under ``.tmp-<id>`` (``snapshot.capture``), fsynced, renamed whole, and only then published by a
  compare-and-set of the ready pointer; any failure deletes the directory;
* restore always uses a fresh container; a rejected checkpoint falls back to the previous one;
* a graceful stop (``close``) destroys every sandbox: sandboxes do not outlive their node (a
  killed service's sandboxes are re-adopted by its restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from common.errors import (
    BelayerError,
    CheckpointBusy,
    CheckpointInvalid,
    Conflict,
    InvalidRequest,
    NotFound,
    ResourceLimit,
    SandboxError,
    Timeout,
)
from common.logging import get_logger
from schemas.env import CheckpointInfo, ReadyPointer, SandboxInfo
from services.environment import core, snapshot
from services.environment import criu_ops as ops
from services.environment.config import EnvConfig
from services.environment.core import Manifest, SandboxRecord, SandboxState
from services.environment.docker_ops import DockerOps, ExecOutput

log = get_logger(component="env.manager")


class ReadyStore(Protocol):
    """Where ready pointers live (JetStream KV in production)."""

    async def get(self, sandbox_id: str) -> tuple[ReadyPointer | None, int]: ...

    async def advance(self, pointer: ReadyPointer, expected_rev: int) -> int: ...

    async def delete(self, sandbox_id: str) -> None: ...

    async def announce(self, info: CheckpointInfo) -> None: ...


class SandboxManager:
    def __init__(self, config: EnvConfig, store: ReadyStore, docker: DockerOps | None = None):
        self.config = config
        self.store = store
        self.docker = docker or DockerOps(config)
        self.records: dict[str, SandboxRecord] = {}
        self.locks: dict[str, asyncio.Lock] = {}

    # --- start-up -----------------------------------------------------------------------
    async def adopt(self) -> None:
        """Re-adopt persisted sandboxes, thaw containers a killed service left frozen, delete
        partial checkpoint directories, reap labelled containers no sandbox owns."""
        self.config.checkpoint_root.mkdir(parents=True, exist_ok=True)
        for tmp in self.config.checkpoint_root.glob(f"*/{core.TMP_PREFIX}*"):
            log.warning("partial_checkpoint_removed", path=str(tmp))
            ops.remove_tree(tmp)
        for rec in core.load_records(self.config.records_dir):
            self.records[rec.id] = rec
            self.locks[rec.id] = asyncio.Lock()
        owned = {r.container_id for r in self.records.values()}
        for cid, sid in await asyncio.to_thread(self.docker.labelled):
            if cid not in owned:
                log.info("orphan_container_reaped", container_id=cid[:12], sandbox_id=sid)
                await asyncio.to_thread(self.docker.remove, cid)
        for rec in self.records.values():
            rec.state = SandboxState.RUNNING.value
            if not await self._running(rec):
                rec.state = SandboxState.FAILED.value
            else:
                pid = int(self.docker.inspect(rec.container_id)["State"]["Pid"])
                control = ops.freezer_path(pid)
                if control is not None and ops.is_frozen(control):
                    ops.thaw(control)
                    log.warning("frozen_container_thawed", sandbox_id=rec.id)
            ptr, _ = await self.store.get(rec.id)
            rec.ready_prefix = ptr.prefix if ptr else None
            rec.checkpoint_id = ptr.checkpoint_id if ptr else None
            self._save(rec)

    async def _running(self, rec: SandboxRecord) -> bool:
        try:
            info = await asyncio.to_thread(self.docker.inspect, rec.container_id)
        except NotFound:
            return False
        return bool(info["State"]["Running"])

    # --- helpers ------------------------------------------------------------------------
    def get(self, sandbox_id: str) -> SandboxRecord:
        rec = self.records.get(sandbox_id)
        if rec is None or rec.status is SandboxState.DESTROYED:
            raise NotFound("unknown sandbox", sandbox_id=sandbox_id)
        return rec

    @contextlib.asynccontextmanager
    async def _locked(self, rec: SandboxRecord, wait: float) -> AsyncIterator[None]:
        lock = self.locks[rec.id]
        try:
            await asyncio.wait_for(lock.acquire(), wait)
        except TimeoutError:
            raise CheckpointBusy(
                "sandbox is busy (exec/checkpoint/restore in progress)", sandbox_id=rec.id
            ) from None
        try:
            self.get(rec.id)  # destroyed while we waited?
            yield
        finally:
            lock.release()

    def _save(self, rec: SandboxRecord) -> None:
        core.save_record(self.config.records_dir, rec)

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.config.checkpoint_root / sandbox_id

    # --- create / destroy / list ----------------------------------------------------------
    async def create(
        self,
        *,
        image: str,
        files: list[tuple[str, bytes, int]],
        limits: core.Limits,
        trajectory_id: str = "",
        sandbox_id: str = "",
    ) -> SandboxRecord:
        sid = core.validate_sandbox_id(sandbox_id) if sandbox_id else core.new_sandbox_id()
        if sid in self.records:
            raise Conflict("sandbox id already in use", sandbox_id=sid)
        live = sum(1 for r in self.records.values() if r.status is not SandboxState.DESTROYED)
        if live >= self.config.max_sandboxes:
            raise ResourceLimit("too many sandboxes", limit=self.config.max_sandboxes)
        for path, _, _ in files:
            if not path.startswith("/") or ".." in path.split("/"):
                raise InvalidRequest("task file path must be absolute without '..'", path=path)
        image = image or self.config.image
        cid = await asyncio.to_thread(self.docker.create, sid, image, limits)
        try:
            await asyncio.to_thread(self.docker.put_files, cid, files)
            await asyncio.to_thread(self.docker.start, cid)
        except BaseException:
            await asyncio.to_thread(self.docker.remove, cid)
            raise
        rec = SandboxRecord(
            id=sid,
            image=image,
            container_id=cid,
            limits=limits,
            trajectory_id=trajectory_id,
            created_at=time.time(),
        )
        self.records[sid] = rec
        self.locks[sid] = asyncio.Lock()
        self._save(rec)
        log.info("sandbox_created", sandbox_id=sid, container_id=cid[:12], image=image)
        return rec

    async def destroy(self, sandbox_id: str) -> None:
        rec = self.get(sandbox_id)
        async with self._locked(rec, self.config.lock_wait_s):
            await self._remove(rec)
        self.locks.pop(rec.id, None)
        log.info("sandbox_destroyed", sandbox_id=sandbox_id)

    async def _remove(self, rec: SandboxRecord) -> None:
        """Container, checkpoints, ready pointer, record — in that order (a failure to remove
        the container keeps everything else, so the sandbox can still be found)."""
        await asyncio.to_thread(self.docker.remove, rec.container_id)
        ops.remove_tree(self.sandbox_dir(rec.id))
        await self.store.delete(rec.id)
        rec.move(SandboxState.DESTROYED)
        core.remove_record(self.config.records_dir, rec.id)
        del self.records[rec.id]

    def sandboxes(self) -> list[SandboxInfo]:
        out = []
        for rec in self.records.values():
            n = len(self._manifests(rec.id))
            out.append(
                SandboxInfo(
                    id=rec.id,
                    container_id=rec.container_id,
                    image=rec.image,
                    state=rec.state,
                    trajectory_id=rec.trajectory_id,
                    ready_prefix=rec.ready_prefix,
                    checkpoint_id=rec.checkpoint_id,
                    checkpoints=n,
                    cooldown_until=rec.cooldown_until,
                )
            )
        return out

    async def gc_trajectory(self, trajectory_id: str) -> int:
        """Drop every checkpoint of a finished trajectory; returns how many were deleted."""
        if not trajectory_id:
            raise InvalidRequest("trajectory_id is required", field="trajectory_id")
        removed = 0
        for rec in list(self.records.values()):
            for m in self._manifests(rec.id):
                if m.trajectory_id == trajectory_id:
                    async with self._locked(rec, self.config.lock_wait_s):
                        ops.remove_tree(self.sandbox_dir(rec.id) / m.checkpoint_id)
                        removed += 1
                        if rec.checkpoint_id == m.checkpoint_id:
                            await self.store.delete(rec.id)
                            rec.ready_prefix = rec.checkpoint_id = None
                            self._save(rec)
        return removed

    # --- exec -----------------------------------------------------------------------------
    async def exec(
        self, sandbox_id: str, command: str, timeout_s: float, workdir: str = ""
    ) -> ExecOutput:
        rec = self.get(sandbox_id)
        if not 0 < timeout_s <= self.config.exec_timeout_max_s:
            raise InvalidRequest(
                "timeout_s out of range", field="timeout_s", max=self.config.exec_timeout_max_s
            )
        async with self._locked(rec, self.config.lock_wait_s):
            if rec.status is SandboxState.FAILED:
                raise SandboxError(
                    "sandbox's container is dead: full_restore it", sandbox_id=rec.id
                )
            try:
                out = await asyncio.to_thread(
                    self.docker.exec,
                    rec.container_id,
                    command,
                    timeout_s=timeout_s,
                    cap=self.config.exec_output_cap,
                    workdir=workdir,
                )
            except (SandboxError, NotFound):
                if not await self._running(rec):
                    rec.move(SandboxState.FAILED)
                    self._save(rec)
                    raise SandboxError(
                        "sandbox's container is dead: full_restore it", sandbox_id=rec.id
                    ) from None
                raise
        if out.timed_out:
            raise Timeout(
                "command ran past its timeout",
                sandbox_id=rec.id,
                timeout_s=timeout_s,
                stdout_tail=out.stdout[-2000:].decode(errors="replace"),
            )
        return out

    # --- full_checkpoint ------------------------------------------------------------------
    async def checkpoint(
        self, sandbox_id: str, prefix: int, trajectory_id: str = "", timeout_s: float = 0.0
    ) -> CheckpointInfo:
        rec = self.get(sandbox_id)
        if prefix < 0:
            raise InvalidRequest("prefix must be >= 0", field="prefix")
        now = time.time()
        if now < rec.cooldown_until:
            raise CheckpointBusy(
                "checkpointing of this sandbox is disabled after a checkpoint timed out",
                sandbox_id=rec.id,
                retry_after_s=round(rec.cooldown_until - now, 3),
            )
        timeout = timeout_s or self.config.checkpoint_timeout_s
        async with self._locked(rec, min(timeout, self.config.lock_wait_s)):
            if rec.status is SandboxState.FAILED:
                raise SandboxError(
                    "sandbox's container is dead: full_restore it", sandbox_id=rec.id
                )
            ptr, rev = await self.store.get(rec.id)
            if ptr is not None and prefix <= ptr.prefix:
                raise Conflict(
                    "prefix must advance past the ready one", prefix=prefix, ready_prefix=ptr.prefix
                )
            trajectory_id = trajectory_id or rec.trajectory_id
            ck_id = core.checkpoint_id_for(rec.id, prefix)
            tmp = self.sandbox_dir(rec.id) / f"{core.TMP_PREFIX}{ck_id}"
            final = self.sandbox_dir(rec.id) / ck_id
            rec.move(SandboxState.CHECKPOINTING)
            try:
                tmp.mkdir(parents=True)
                start = time.monotonic()
                try:
                    manifest = await asyncio.wait_for(
                        snapshot.capture(
                            self.docker, self.config, rec, tmp, ck_id, prefix, trajectory_id
                        ),
                        timeout,
                    )
                except TimeoutError:
                    rec.cooldown_until = time.time() + self.config.cooldown_s
                    raise Timeout(
                        "checkpoint ran past its deadline; checkpointing disabled for a cooldown",
                        sandbox_id=rec.id,
                        timeout_s=timeout,
                        cooldown_s=self.config.cooldown_s,
                    ) from None
                tmp.rename(final)
                if self.config.fsync:
                    ops.fsync_dir(final.parent)
                manifest.durations["total_s"] = time.monotonic() - start
                info = snapshot.checkpoint_info(manifest)
                pointer = ReadyPointer(
                    sandbox_id=rec.id,
                    prefix=prefix,
                    checkpoint_id=ck_id,
                    trajectory_id=trajectory_id,
                    ts=time.time(),
                )
                try:
                    await self.store.advance(pointer, rev)
                except BaseException:
                    ops.remove_tree(final)
                    raise
            except BaseException:
                ops.remove_tree(tmp)
                if rec.status is SandboxState.CHECKPOINTING:
                    rec.move(SandboxState.RUNNING)
                raise
            rec.move(SandboxState.RUNNING)
            rec.ready_prefix, rec.checkpoint_id = prefix, ck_id
            self._save(rec)
            self._prune(rec)
        await self.store.announce(info)
        log.info(
            "checkpoint_ready",
            sandbox_id=rec.id,
            prefix=prefix,
            checkpoint_id=ck_id,
            total_s=round(info.total_s, 4),
            method=info.method,
        )
        return info

    def _prune(self, rec: SandboxRecord) -> None:
        keep = max(1, self.config.keep_checkpoints)
        manifests = sorted(self._manifests(rec.id), key=lambda m: m.prefix, reverse=True)
        for m in manifests[keep:]:
            if m.checkpoint_id != rec.checkpoint_id:
                ops.remove_tree(self.sandbox_dir(rec.id) / m.checkpoint_id)

    def _manifests(self, sandbox_id: str) -> list[Manifest]:
        out: list[Manifest] = []
        base = self.sandbox_dir(sandbox_id)
        if not base.is_dir():
            return out
        for d in base.iterdir():
            if d.name.startswith(".") or not d.is_dir():
                continue
            try:
                out.append(core.read_manifest(d))
            except CheckpointInvalid:
                out.append(snapshot.unreadable_manifest(sandbox_id, d.name))
        return out

    # --- full_restore ---------------------------------------------------------------------
    async def restore(
        self, sandbox_id: str, checkpoint_id: str = ""
    ) -> tuple[SandboxRecord, Manifest, float, str]:
        """Returns (record, manifest used, seconds, rejected checkpoint id or "")."""
        rec = self.get(sandbox_id)
        if checkpoint_id:
            self._check_owner(rec.id, checkpoint_id)
        start = time.monotonic()
        async with self._locked(rec, self.config.lock_wait_s):
            ptr, rev = await self.store.get(rec.id)
            candidates = core.restore_candidates(
                self._manifests(rec.id),
                ready_checkpoint_id=ptr.checkpoint_id if ptr else None,
                requested=checkpoint_id or None,
            )
            if not candidates:
                raise NotFound(
                    "no ready checkpoint to restore",
                    sandbox_id=rec.id,
                    checkpoint_id=checkpoint_id or None,
                )
            old_state = rec.status
            rec.move(SandboxState.RESTORING)
            await asyncio.to_thread(self.docker.remove, rec.container_id)
            rejected: list[str] = []
            errors: list[BelayerError] = []
            for m in candidates:
                try:
                    cid = await asyncio.wait_for(
                        snapshot.restore_one(
                            self.docker,
                            self.config,
                            rec,
                            self.sandbox_dir(rec.id) / m.checkpoint_id,
                            m,
                        ),
                        self.config.restore_timeout_s,
                    )
                except (BelayerError, TimeoutError) as exc:
                    err = (
                        exc
                        if isinstance(exc, BelayerError)
                        else Timeout("restore ran past its deadline")
                    )
                    log.warning(
                        "checkpoint_rejected",
                        sandbox_id=rec.id,
                        checkpoint_id=m.checkpoint_id,
                        error=str(err),
                    )
                    rejected.append(m.checkpoint_id)
                    errors.append(err)
                    if checkpoint_id:
                        break
                    continue
                rec.container_id = cid
                rec.move(SandboxState.RUNNING)
                rec.restores += 1
                if ptr is None or m.checkpoint_id != ptr.checkpoint_id:
                    pointer = ReadyPointer(
                        sandbox_id=rec.id,
                        prefix=m.prefix,
                        checkpoint_id=m.checkpoint_id,
                        trajectory_id=m.trajectory_id,
                        ts=time.time(),
                    )
                    if ptr is None or m.prefix <= ptr.prefix:
                        with contextlib.suppress(Conflict):
                            await self.store.advance(pointer, rev)
                rec.ready_prefix, rec.checkpoint_id = m.prefix, m.checkpoint_id
                self._save(rec)
                for bad, err in zip(rejected, errors, strict=True):
                    if isinstance(err, CheckpointInvalid):
                        ops.remove_tree(self.sandbox_dir(rec.id) / bad)
                return rec, m, time.monotonic() - start, ",".join(rejected)
            rec.state = SandboxState.FAILED.value
            _ = old_state
            self._save(rec)
            first = errors[0]
            if not any(isinstance(e, CheckpointInvalid) for e in errors):
                raise first
            raise CheckpointInvalid(
                "no usable checkpoint: " + "; ".join(str(e) for e in errors),
                sandbox_id=rec.id,
                rejected=",".join(rejected),
            )

    def _check_owner(self, sandbox_id: str, checkpoint_id: str) -> None:
        if not (self.sandbox_dir(sandbox_id) / checkpoint_id).is_dir():
            for other in self.config.checkpoint_root.glob(f"*/{checkpoint_id}"):
                raise Conflict(
                    "checkpoint belongs to another sandbox",
                    checkpoint_id=checkpoint_id,
                    owner=other.parent.name,
                    sandbox_id=sandbox_id,
                )
            raise NotFound("unknown checkpoint", checkpoint_id=checkpoint_id, sandbox_id=sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        """Chaos helper: ``docker kill`` the sandbox's container."""
        rec = self.get(sandbox_id)
        await asyncio.to_thread(self.docker.kill, rec.container_id)

    async def close(self) -> None:
        """Graceful stop (after the server stopped taking requests): wait, bounded by one
        ``lock_wait_s`` in all, for in-flight operations, then destroy every sandbox and reap
        whatever else of this node is left — a stopped service leaves no container and no
        checkpoint directory behind (sandboxes do not outlive their node)."""
        deadline = time.monotonic() + self.config.lock_wait_s
        for lock in list(self.locks.values()):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lock.acquire(), max(0.0, deadline - time.monotonic()))
                lock.release()
        await self.destroy_all()

    async def destroy_all(self) -> int:
        """Destroy every sandbox (a busy one too: its operation is abandoned), then remove this
        node's labelled containers and the checkpoint directories no sandbox owns. Returns how
        many sandboxes were destroyed; a failure (dockerd unreachable) is logged and leaves the
        failed sandbox's record for the next start to adopt."""
        destroyed = 0
        for rec in list(self.records.values()):
            if rec.status in (SandboxState.CHECKPOINTING, SandboxState.RESTORING):
                rec.move(SandboxState.FAILED)  # its operation ran past the drain and is dropped
            try:
                await self._remove(rec)
            except BelayerError as exc:
                log.warning("sandbox_destroy_failed", sandbox_id=rec.id, error=str(exc))
                continue
            self.locks.pop(rec.id, None)
            destroyed += 1
            log.info("sandbox_destroyed", sandbox_id=rec.id, reason="shutdown")
        try:
            for cid, sid in await asyncio.to_thread(self.docker.labelled):
                if not any(r.container_id == cid for r in self.records.values()):
                    log.info("orphan_container_reaped", container_id=cid[:12], sandbox_id=sid)
                    await asyncio.to_thread(self.docker.remove, cid)
        except SandboxError as exc:
            log.warning("orphan_reap_failed", error=str(exc))
        if self.config.checkpoint_root.is_dir():
            for d in self.config.checkpoint_root.iterdir():
                if d.name not in self.records:
                    ops.remove_tree(d)
        return destroyed
