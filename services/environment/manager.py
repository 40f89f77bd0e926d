"""The sandbox manager: create/exec/full_checkpoint/full_restore/destroy over Docker + CRIU.

Bus-agnostic: it publishes ready checkpoints through a ``ReadyStore`` (the service backs it
with a JetStream KV bucket and stream). Its helpers ``lifecycle`` and ``restore`` get the
manager as the narrow ``ports.Fleet`` / ``ports.RestoreHost`` (what each uses of it, nothing
more). Invariants it keeps:

* exec and checkpoint of one sandbox exclude each other (one asyncio lock per sandbox);
* a checkpoint is captured while the container's cgroup is frozen (files, then processes),
  written under ``.tmp-<id>`` (``snapshot.capture``), fsynced, renamed whole, and only then
  published by a compare-and-set of the ready pointer; any failure deletes the directory;
* a sandbox Docker has paused stays paused through a checkpoint, and exec on it is a
  ``Conflict``; a container that dies during a checkpoint is ``failed``, never ``running``, and
  the answer says whether the dump completed first;
* restore always uses a fresh container, verified running before the old one is given up; a
  checkpoint that fails to restore is quarantined and the previous one tried
  (``restore.full_restore``); pruning keeps the last checkpoint that restored;
* start-up and stop are in ``lifecycle``: adoption of earlier sandboxes, reaping of what no
  sandbox owns, and a graceful stop that destroys every sandbox (or keeps them for the next
  start after ``belayer down --keep-sandboxes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

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
from common.heartbeat import process_exiting
from common.logging import get_logger
from common.tasks import keep
from schemas.env import CheckpointInfo, ReadyPointer, SandboxInfo
from services.environment import core, lifecycle, quiescent, snapshot
from services.environment import criu_ops as ops
from services.environment.config import EnvConfig
from services.environment.core import Manifest, SandboxRecord, SandboxState
from services.environment.docker_ops import DockerOps, ExecOutput
from services.environment.ports import CheckpointStore, ReadyStore
from services.environment.restore import Restored, full_restore, quarantined

log = get_logger(component="env.manager")
WRAPPER = Path(__file__).with_name("belayer-runc")
"""The ``belayer`` OCI runtime this service ships (``deploy/install_env.sh`` installs it)."""


class SandboxManager:
    def __init__(
        self,
        config: EnvConfig,
        store: ReadyStore,
        docker: DockerOps | None = None,
        objects: CheckpointStore | None = None,
    ):
        self.config = config
        self.store = store
        self.objects = objects
        """Ready checkpoints beyond this host: each is put there before it is published when
        ``config.checkpoint_store``; a restore ``from_store`` fetches what this host lacks."""
        self.docker = docker or DockerOps(config)
        self.records: dict[str, SandboxRecord] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self._restore_method: str | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        """Removals of containers a restore replaced (off the restore's critical path)."""
        self._freezers: dict[str, Path | None] = {}
        """Container id → its freezer control file (looked up once per container)."""
        self.dev_baselines: dict[str, quiescent.DevSignature] = {}
        """Image → a fresh container's ``/dev`` (learned at the image's first ``create``):
        what a quiescent sandbox's ``/dev`` must match for a layer-only checkpoint."""

    # --- start-up and stop (``lifecycle``) ------------------------------------------------
    async def adopt(self) -> None:
        """See ``lifecycle.adopt``."""
        await lifecycle.adopt(self)

    async def close(self) -> None:
        """See ``lifecycle.close``."""
        await lifecycle.close(self)

    async def destroy_all(self) -> int:
        """See ``lifecycle.destroy_all``."""
        return await lifecycle.destroy_all(self)

    async def restore_method(self) -> str:
        """How restores start the fresh container (``snapshot.restore_method``; decided once)."""
        if self._restore_method is None:
            method = await asyncio.to_thread(
                snapshot.restore_method, self.config, self.docker, WRAPPER
            )
            if method == "docker":
                log.warning(
                    "restore_runtime_unavailable",
                    runtime=self.config.restore_runtime,
                    hint="deploy/install_env.sh registers it; restores use Docker's slower path",
                )
            self._restore_method = method
        return self._restore_method

    def retire(self, container_id: str) -> None:
        """Remove a container a restore replaced, in the background (``settle`` awaits it; if
        the service dies first, the next start reaps it: it carries the run's label)."""

        async def go() -> None:
            try:
                await asyncio.to_thread(self.docker.remove, container_id)
            except BelayerError as exc:
                log.warning(
                    "old_container_remove_failed", container_id=container_id[:12], error=str(exc)
                )

        keep(self._retiring, asyncio.create_task(go()))

    async def settle(self) -> None:
        """Wait for the background removals of replaced containers."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def running(self, rec: SandboxRecord) -> bool:
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

    def save(self, rec: SandboxRecord) -> None:
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
            if image not in self.dev_baselines and self.config.layer_only_when_quiescent:
                await asyncio.to_thread(self._learn_dev, image, cid)
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
        self.save(rec)
        log.info("sandbox_created", sandbox_id=sid, container_id=cid[:12], image=image)
        return rec

    def _learn_dev(self, image: str, container_id: str) -> None:
        """Record a just-started container's ``/dev`` as its image's fresh ``/dev``."""
        pid = int(self.docker.inspect(container_id)["State"]["Pid"] or 0)
        signature = quiescent.dev_signature(pid) if pid > 0 else None
        if signature is not None:
            self.dev_baselines[image] = signature

    async def destroy(self, sandbox_id: str) -> None:
        rec = self.get(sandbox_id)
        async with self._locked(rec, self.config.lock_wait_s):
            await self.remove(rec)
        self.locks.pop(rec.id, None)
        log.info("sandbox_destroyed", sandbox_id=sandbox_id)

    async def remove(self, rec: SandboxRecord) -> None:
        """Container, checkpoints, ready pointer, record — in that order (a failure to remove
        the container keeps everything else, so the sandbox can still be found)."""
        await asyncio.to_thread(self.docker.remove, rec.container_id)
        stored = {m.checkpoint_id for m in self.manifests(rec.id)}
        if self.objects is not None:
            with contextlib.suppress(BelayerError):
                ptr, _ = await self.store.get(rec.id)
                stored |= set(ptr.manifests) if ptr is not None else set()
        ops.remove_tree(self.sandbox_dir(rec.id))
        await self.store.delete(rec.id)
        for ck in sorted(stored):
            self.forget(ck)
        rec.move(SandboxState.DESTROYED)
        core.remove_record(self.config.records_dir, rec.id)
        del self.records[rec.id]

    def sandboxes(self) -> list[SandboxInfo]:
        out = []
        for rec in self.records.values():
            n = len(self.manifests(rec.id))
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
            for q in quarantined(self.sandbox_dir(rec.id)):
                with contextlib.suppress(CheckpointInvalid):
                    if core.read_manifest(q).trajectory_id == trajectory_id:
                        ops.remove_tree(q)
            for m in self.manifests(rec.id):
                if m.trajectory_id == trajectory_id:
                    async with self._locked(rec, self.config.lock_wait_s):
                        ops.remove_tree(self.sandbox_dir(rec.id) / m.checkpoint_id)
                        self.forget(m.checkpoint_id)
                        removed += 1
                        if rec.checkpoint_id == m.checkpoint_id:
                            await self.store.delete(rec.id)
                            rec.ready_prefix = rec.checkpoint_id = None
                            self.save(rec)
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
            await self._not_frozen(rec)
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
                if not await self.running(rec):
                    rec.move(SandboxState.FAILED)
                    self.save(rec)
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

    async def _not_frozen(self, rec: SandboxRecord) -> None:
        """Exec into a frozen cgroup would hang until its timeout: a sandbox Docker paused is a
        ``Conflict``; a freeze a killed service left behind (Docker does not know of it) is
        thawed. Outside a checkpoint (the lock is held) nothing else freezes a sandbox."""
        cid = rec.container_id
        if cid not in self._freezers:
            try:
                pid = int((await asyncio.to_thread(self.docker.inspect, cid))["State"]["Pid"])
            except NotFound:
                return
            live = {r.container_id for r in self.records.values()}
            self._freezers = {c: f for c, f in self._freezers.items() if c in live}
            self._freezers[cid] = ops.freezer_path(pid)
        control = self._freezers[cid]
        if control is None or not ops.is_frozen(control):
            return
        if await asyncio.to_thread(self.docker.paused, cid):
            raise Conflict(
                "the sandbox is paused (docker pause): unpause it before exec",
                sandbox_id=rec.id,
                state="paused",
            )
        ops.thaw(control)
        log.warning("frozen_container_thawed", sandbox_id=rec.id)

    # --- full_checkpoint ------------------------------------------------------------------
    async def checkpoint(
        self, sandbox_id: str, prefix: int, trajectory_id: str = "", timeout_s: float = 0.0
    ) -> CheckpointInfo:
        rec = self.get(sandbox_id)
        self._may_checkpoint(rec, prefix)
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
            progress = snapshot.Progress()
            try:
                tmp.mkdir(parents=True)
                start = time.monotonic()
                manifest = await self._capture(
                    rec, tmp, ck_id, prefix, trajectory_id, timeout, progress
                )
                exited = process_exiting(progress.pid)  # its init (no dockerd call)
                tmp.rename(final)
                if self.config.fsync:  # off the event loop: a journal commit can take seconds
                    await asyncio.to_thread(ops.fsync_dir, final.parent)
                manifest.durations["total_s"] = time.monotonic() - start
                digest = core.manifest_digest(final)
                info = snapshot.checkpoint_info(
                    manifest, container_exited=exited, manifest_sha256=digest
                )
                kept = {m.checkpoint_id for m in self.manifests(rec.id)}
                pointer = ReadyPointer(
                    sandbox_id=rec.id,
                    prefix=prefix,
                    checkpoint_id=ck_id,
                    trajectory_id=trajectory_id,
                    ts=time.time(),
                    manifests=core.carry_manifests(
                        ptr.manifests if ptr else {}, kept, ck_id, digest
                    ),
                )
                try:
                    if self.objects is not None and self.config.checkpoint_store:
                        await self.objects.put(ck_id, final)
                    await self.store.advance(pointer, rev)
                except BaseException:
                    self.forget(ck_id)
                    ops.remove_tree(final)
                    raise
            except BaseException:
                ops.remove_tree(tmp)
                if rec.status is SandboxState.CHECKPOINTING:
                    rec.move(SandboxState.RUNNING)
                self.save(rec)
                raise
            rec.move(SandboxState.FAILED if exited else SandboxState.RUNNING)
            rec.ready_prefix, rec.checkpoint_id = prefix, ck_id
            self.save(rec)
            self._prune(rec)
        await self.store.announce(info)
        log.info(
            "checkpoint_ready",
            sandbox_id=rec.id,
            prefix=prefix,
            checkpoint_id=ck_id,
            total_s=round(info.total_s, 4),
            method=info.method,
            container_exited=exited,
        )
        return info

    @staticmethod
    def _may_checkpoint(rec: SandboxRecord, prefix: int) -> None:
        """Refuse a negative prefix, and any checkpoint during the cooldown after a timeout."""
        if prefix < 0:
            raise InvalidRequest("prefix must be >= 0", field="prefix")
        now = time.time()
        if now < rec.cooldown_until:
            raise CheckpointBusy(
                "checkpointing of this sandbox is disabled after a checkpoint timed out",
                sandbox_id=rec.id,
                retry_after_s=round(rec.cooldown_until - now, 3),
            )

    async def _capture(
        self,
        rec: SandboxRecord,
        tmp: Path,
        ck_id: str,
        prefix: int,
        trajectory_id: str,
        timeout: float,
        progress: snapshot.Progress,
    ) -> Manifest:
        """``snapshot.capture`` under the deadline; a container found dead after a failure makes
        the sandbox ``failed`` and the error say whether the dump had completed."""
        try:
            return await asyncio.wait_for(
                snapshot.capture(
                    self.docker,
                    self.config,
                    rec,
                    tmp,
                    ck_id,
                    prefix,
                    trajectory_id,
                    progress,
                    self.dev_baselines.get(rec.image),
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
        except BelayerError as exc:
            if rec.status is not SandboxState.CHECKPOINTING or await snapshot.container_alive(
                self.docker, rec.container_id
            ):
                raise
            rec.move(SandboxState.FAILED)
            when = "after" if progress.dumped else "before"
            raise SandboxError(
                f"the sandbox's container died during the checkpoint, {when} the dump completed "
                "(the checkpoint is dropped; full_restore the sandbox)",
                sandbox_id=rec.id,
                dump_completed=progress.dumped,
                error=str(exc),
            ) from None

    def _prune(self, rec: SandboxRecord) -> None:
        """Keep ``keep_checkpoints`` (quarantined ones do not count), the ready one and the
        last one that restored."""
        protected = {c for c in (rec.checkpoint_id, rec.verified_checkpoint_id) if c}
        plan = core.prune_plan(self.manifests(rec.id), self.config.keep_checkpoints, protected)
        for ck in plan:
            ops.remove_tree(self.sandbox_dir(rec.id) / ck)
            self.forget(ck)

    def forget(self, checkpoint_id: str) -> None:
        """Delete a checkpoint's object from the store, in the background (``settle`` awaits
        it; one left behind by a dead service expires with the bucket's TTL)."""
        if self.objects is not None and self.config.checkpoint_store:
            keep(self._retiring, asyncio.create_task(self.objects.delete(checkpoint_id)))

    def manifests(self, sandbox_id: str) -> list[Manifest]:
        """The manifests of a sandbox's checkpoints (not the partial or quarantined ones)."""
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
        self, sandbox_id: str, checkpoint_id: str = "", taken: SandboxRecord | None = None
    ) -> Restored:
        """See ``restore.full_restore``. ``taken``: the sandbox as it lived on another host,
        restored here from the checkpoint store (``from_store``)."""
        if taken is not None:
            rec, checkpoint_id = await self._from_store(taken, checkpoint_id)
        else:
            rec = self.get(sandbox_id)
            if checkpoint_id:
                self._check_owner(rec.id, checkpoint_id)
        async with self._locked(rec, self.config.lock_wait_s):
            return await full_restore(self, rec, checkpoint_id)

    async def _from_store(
        self, taken: SandboxRecord, checkpoint_id: str
    ) -> tuple[SandboxRecord, str]:
        """Make ``taken`` (unknown here, or known with fewer checkpoints) a sandbox of this host
        and fetch ``checkpoint_id`` (default: the ready one) from the store unless it is on
        local disk. The restore that follows verifies it against the ready pointer."""
        rec = self.records.get(taken.id)
        if rec is None or rec.status is SandboxState.DESTROYED:
            if self.objects is None:
                raise NotFound("unknown sandbox (no checkpoint store here)", sandbox_id=taken.id)
            live = sum(1 for r in self.records.values() if r.status is not SandboxState.DESTROYED)
            if live >= self.config.max_sandboxes:
                raise ResourceLimit("too many sandboxes", limit=self.config.max_sandboxes)
            rec = taken
            self.records[rec.id], self.locks[rec.id] = rec, asyncio.Lock()
            self.save(rec)
            log.info("sandbox_taken_over", sandbox_id=rec.id, trajectory_id=rec.trajectory_id)
        if not checkpoint_id:
            ptr, _ = await self.store.get(rec.id)
            if ptr is None:
                raise NotFound("no ready checkpoint of this sandbox", sandbox_id=rec.id)
            checkpoint_id = ptr.checkpoint_id
        directory = self.sandbox_dir(rec.id) / checkpoint_id
        base = self.sandbox_dir(rec.id)
        if (
            not directory.is_dir()
            and not (base / f"{core.QUARANTINE_PREFIX}{checkpoint_id}").is_dir()
        ):
            async with self._locked(rec, self.config.lock_wait_s):
                if not directory.is_dir() and self.objects is not None:
                    await self.objects.fetch(checkpoint_id, directory)
        return rec, checkpoint_id

    def _check_owner(self, sandbox_id: str, checkpoint_id: str) -> None:
        base = self.sandbox_dir(sandbox_id)
        if (base / f"{core.QUARANTINE_PREFIX}{checkpoint_id}").is_dir():
            return  # ours, refused as quarantined by the restore
        if not (base / checkpoint_id).is_dir():
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
