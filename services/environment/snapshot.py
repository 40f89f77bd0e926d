"""One checkpoint's I/O, apart from the manager's orchestration (locks, pointers, fallback):
``capture`` freezes a container and writes its file-system layer and process images into a
checkpoint directory; ``restore_one`` validates one checkpoint, rebuilds a fresh container
from it and checks that it runs."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from common.errors import BelayerError, CheckpointInvalid, Conflict, NotFound, SandboxError
from common.heartbeat import process_exiting
from schemas.env import CheckpointInfo
from services.environment import core, quiescent
from services.environment import criu_ops as ops
from services.environment.archive import validate_archive
from services.environment.config import EnvConfig
from services.environment.core import Manifest, SandboxRecord, SandboxState
from services.environment.docker_ops import DockerOps

T = TypeVar("T")

LAYER = "layer"
"""The method of a checkpoint that is the writable layer alone (a quiescent sandbox)."""


class Progress:
    """How far one ``capture`` got (read by the caller when it fails)."""

    def __init__(self) -> None:
        self.dumped = False
        """The process dump completed."""
        self.pid = 0
        """The container's init pid (host view) when the capture started."""


async def capture(
    docker: DockerOps,
    config: EnvConfig,
    rec: SandboxRecord,
    tmp: Path,
    ck_id: str,
    prefix: int,
    trajectory_id: str,
    progress: Progress,
    baseline: quiescent.DevSignature | None = None,
) -> Manifest:
    """Freeze → archive the upper dir → dump processes → back to the previous freeze state →
    hash → manifest → fsync. A sandbox Docker has paused (``docker pause``) stays paused (thawing
    it behind Docker's back would wedge it: exec says "is paused", unpause is refused); any other
    frozen cgroup is a freeze a killed service left behind, and is thawed.

    A quiescent sandbox (``quiescent``; ``baseline``: a fresh container's ``/dev``) is not
    dumped when ``config.layer_only_when_quiescent``: its checkpoint is the layer alone
    (method ``layer``)."""
    info = await asyncio.to_thread(docker.inspect, rec.container_id)
    if not info["State"]["Running"]:
        raise _died_before_dump(rec, "is not running: it died before the dump completed")
    pid = int(info["State"]["Pid"])
    progress.pid = pid
    paused = bool(info["State"].get("Paused"))
    upper = str(info["GraphDriver"]["Data"]["UpperDir"])
    method, root = checkpoint_method(config, rec.container_id)
    control = ops.freezer_path(pid)
    if control is None and process_exiting(pid):
        # Killed between the inspect and here: its cgroup went with it. Docker may not have
        # noticed yet, and its init may not be a zombie yet (it waits for its children), so
        # this is the death the caller must hear of, not a missing cgroup.
        raise _died_before_dump(rec)
    if control is None:
        raise SandboxError("cannot find the container's freezer cgroup", sandbox_id=rec.id)
    t0 = time.monotonic()
    watch = _PauseWatch(docker, rec, armed=not paused)
    try:
        await ops.freeze(control)
    except OSError:  # the cgroup went away under the freeze: killed meanwhile?
        if not process_exiting(pid):
            raise
        raise _died_before_dump(rec) from None
    try:
        if config.layer_only_when_quiescent and not paused:
            try:
                why = await quiescent.reason(control, pid, baseline)
            except OSError:  # its cgroup or /proc entries went away: killed meanwhile?
                if not process_exiting(pid):
                    raise
                raise _died_before_dump(rec) from None
            method = LAYER if why is None else method
        t1 = time.monotonic()
        fs_bytes = await watch.bound(ops.archive_layer(upper, tmp / core.FS_ARCHIVE, timeout=60.0))
        t2 = time.monotonic()
        await watch.bound(
            _dump_processes(docker, config, rec.container_id, method, root, tmp), dump=True
        )
        progress.dumped = True
        t3 = time.monotonic()
    finally:
        if not paused and not watch.seen:  # Docker's pause keeps its freeze
            ops.thaw(control)
    durations = {"freeze_s": time.monotonic() - t0, "fs_s": t2 - t1, "dump_s": t3 - t2}
    ops.remove_tree(tmp / "work")
    ids = (rec, trajectory_id, prefix, ck_id)
    return await _write_manifest(config, tmp, ids, method, fs_bytes, durations)


async def _write_manifest(
    config: EnvConfig,
    tmp: Path,
    ids: tuple[SandboxRecord, str, int, str],
    method: str,
    fs_bytes: int,
    durations: dict[str, float],
) -> Manifest:
    """The manifest of the checkpoint captured in ``tmp`` (``ids``: the sandbox, trajectory,
    prefix and checkpoint id), hashed, written and, with ``config.fsync``, on disk."""
    rec, trajectory_id, prefix, ck_id = ids
    manifest = Manifest(
        sandbox_id=rec.id,
        trajectory_id=trajectory_id,
        prefix=prefix,
        checkpoint_id=ck_id,
        image=rec.image,
        created_at=time.time(),
        fs_bytes=fs_bytes,
        fs_sha256=await asyncio.to_thread(ops.sha256_file, tmp / core.FS_ARCHIVE),
        criu_bytes=0,
        criu_files=ops.dir_files(tmp / core.CRIU_DIR),
        criu_sha256=await asyncio.to_thread(ops.dir_digests, tmp / core.CRIU_DIR),
        method=method,
        durations=durations,
    )
    manifest.criu_bytes = sum(manifest.criu_files.values())
    core.write_manifest(tmp, manifest)
    if config.fsync:
        await asyncio.to_thread(ops.fsync_tree, tmp, skip_pages=not config.fsync_page_images)
    return manifest


def _died_before_dump(
    rec: SandboxRecord, what: str = "died during the checkpoint, before the dump completed"
) -> SandboxError:
    """The sandbox (now ``failed``) lost its container before the process dump completed
    (``what``: it died during the capture, or Docker already says it is not running)."""
    rec.move(SandboxState.FAILED)
    return SandboxError(
        f"the sandbox's container {what} (the checkpoint is dropped; full_restore the sandbox)",
        sandbox_id=rec.id,
        dump_completed=False,
    )


PAUSE_POLL_S = 0.25
"""How often a checkpoint of a running sandbox asks Docker whether it was paused meanwhile."""


class _PauseWatch:
    """A ``docker pause`` that lands while a running sandbox is being checkpointed: runc's
    checkpoint of a container Docker pauses under it can hang to the checkpoint's deadline (and
    thawing it afterwards would leave Docker saying paused about a running container). Each
    step of the capture is raced against Docker's container list, read every
    ``PAUSE_POLL_S``; the pause stops the capture at once as the sandbox's failure
    (``Conflict``, state ``paused``, as an exec's), and the freeze is left to Docker."""

    def __init__(self, docker: DockerOps, rec: SandboxRecord, *, armed: bool) -> None:
        self.docker = docker
        self.rec = rec
        self.armed = armed
        self.seen = False

    async def _paused(self) -> None:
        while True:
            await asyncio.sleep(PAUSE_POLL_S)  # the poll's pace
            try:
                paused = await asyncio.to_thread(self.docker.paused, self.rec.container_id)
            except BelayerError:  # Docker did not answer this time: not known to be paused
                continue
            if paused:
                self.seen = True
                return

    async def bound(self, step: Awaitable[T], *, dump: bool = False) -> T:
        """``step``'s result, unless Docker pauses the sandbox first (``Conflict``). A ``dump``
        stopped half-way (CRIU killed among the container's processes) leaves them in no state
        to trust: the sandbox is then failed, to be restored."""
        if not self.armed:
            return await step
        work = asyncio.ensure_future(step)
        watcher = asyncio.ensure_future(self._paused())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watcher):
                if not task.done():
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, BelayerError):
                await asyncio.gather(work, watcher, return_exceptions=False)
        if not self.seen or (work.done() and not work.cancelled()):
            return work.result()  # finished (or failed) first: its own outcome
        if dump:
            self.rec.move(SandboxState.FAILED)
        raise Conflict(
            "the sandbox was paused (docker pause) during its checkpoint"
            + (", mid-dump: it failed, restore it" if dump else ": unpause it or restore"),
            sandbox_id=self.rec.id,
            state="failed" if dump else "paused",
        )


async def _dump_processes(
    docker: DockerOps, config: EnvConfig, container_id: str, method: str, root: Path, tmp: Path
) -> None:
    """The frozen container's processes into ``tmp/criu`` by ``method``: CRIU through runc,
    Docker's checkpoint API, or nothing (an empty directory) for a ``layer`` checkpoint."""
    if method == LAYER:
        (tmp / core.CRIU_DIR).mkdir()
    elif method == "runc":
        await ops.runc_checkpoint(
            config.runc_bin,
            root,
            container_id,
            tmp / core.CRIU_DIR,
            tmp / "work",
            timeout=max(1.0, config.checkpoint_timeout_s),
        )
    else:
        await asyncio.to_thread(docker.checkpoint_create, container_id, core.CRIU_DIR, str(tmp))


def checkpoint_method(config: EnvConfig, container_id: str) -> tuple[str, Path]:
    """``("runc", runc root)`` (CRIU through runc on the Docker-managed container) when runc
    knows the container — under the default runtime or the restore runtime — else Docker's
    checkpoint API (or whatever the config forces)."""
    m = config.checkpoint_method
    if m == "docker":
        return "docker", config.runc_root
    for root in (config.runc_root, config.restore_runc_root):
        if ops.runc_knows(root, container_id):
            return "runc", root
    if m == "runc":
        raise SandboxError("runc does not know the container", runc_root=str(config.runc_root))
    return "docker", config.runc_root


async def container_alive(docker: DockerOps, container_id: str) -> bool:
    """Docker says running and its init process (host pid) has not begun to exit."""
    try:
        info = await asyncio.to_thread(docker.inspect, container_id)
    except NotFound:
        return False
    state = info["State"]
    return bool(state.get("Running")) and not process_exiting(int(state.get("Pid") or 0))


class NotTheCheckpoint(Exception):
    """A restore step failed for a reason outside the checkpoint (dockerd unreachable, no fresh
    container could be made): the checkpoint is not to blame and stays a candidate."""

    def __init__(self, error: BelayerError) -> None:
        super().__init__(str(error))
        self.error = error


def validate(
    config: EnvConfig, rec: SandboxRecord, d: Path, m: Manifest, recorded: dict[str, str] | None
) -> None:
    """Everything about one checkpoint that can be checked without restoring it: the manifest
    is the one the ready pointer recorded (``recorded``: checkpoint id → manifest digest;
    ``None`` without a pointer), its version, owner and name; the archive's members; the size
    and digest of every artifact. Blocking."""
    if m.method == "unreadable":
        raise CheckpointInvalid("checkpoint manifest is corrupt", checkpoint_id=m.checkpoint_id)
    core.check_manifest_digest(m.checkpoint_id, core.manifest_digest(d), recorded)
    core.check_manifest(m, sandbox_id=rec.id, checkpoint_id=d.name)
    if m.method == LAYER:
        images = d / core.CRIU_DIR
        if m.criu_files or m.criu_sha256 or (images.is_dir() and any(images.iterdir())):
            raise CheckpointInvalid(
                "a layer-only checkpoint holds process images", checkpoint_id=m.checkpoint_id
            )
    else:
        core.check_criu_files(d, m)
    archive = d / core.FS_ARCHIVE
    if not archive.is_file() or ops.sha256_file(archive) != m.fs_sha256:
        raise CheckpointInvalid(
            "file-system archive checksum mismatch", checkpoint_id=m.checkpoint_id
        )
    validate_archive(archive, config.archive_limits)  # bytes as recorded, members still checked
    on_disk = ops.dir_digests(d / core.CRIU_DIR)
    for name in sorted(set(on_disk) | set(m.criu_sha256)):
        if on_disk.get(name) != m.criu_sha256.get(name):
            raise CheckpointInvalid(
                "CRIU image checksum mismatch", checkpoint_id=m.checkpoint_id, name=name
            )


async def restore_one(
    docker: DockerOps,
    config: EnvConfig,
    rec: SandboxRecord,
    d: Path,
    m: Manifest,
    method: str,
    recorded: dict[str, str] | None = None,
) -> str:
    """Validate one checkpoint, then fresh container ← layer ← processes (none for a ``layer``
    checkpoint: the fresh container's init is its process state), then check that the new
    container runs. Returns the new container's id; on any failure the new container is
    removed (the sandbox's current container is untouched). ``NotTheCheckpoint`` when the
    failure is not the checkpoint's (no fresh container, dockerd unreachable)."""
    await asyncio.to_thread(validate, config, rec, d, m, recorded)
    if m.method == LAYER:
        method = LAYER  # a fresh container from the image: no process images to restore
    runtime = config.restore_runtime if method == "runtime" else None
    try:
        cid = await asyncio.to_thread(
            docker.create, rec.id, m.image or rec.image, rec.limits, runtime
        )
    except BelayerError as exc:
        raise NotTheCheckpoint(exc) from None
    try:
        upper = await asyncio.to_thread(docker.upper_dir, cid)
        await ops.install_layer(d / core.FS_ARCHIVE, upper, timeout=120.0)
        if method == LAYER:
            await asyncio.to_thread(docker.start, cid)
        else:
            cdir = Path(await asyncio.to_thread(docker.container_dir, cid))
            images = cdir / "checkpoints" / ("belayer-" + m.checkpoint_id[-16:])
            ops.link_or_copy_tree(d / core.CRIU_DIR, images)
            if method == "runtime":
                await asyncio.to_thread(start_restoring, docker, config, cid, images)
            else:
                await asyncio.to_thread(docker.start, cid, images.name)
        if not await container_alive(docker, cid):
            raise SandboxError(
                "the restored container is not running", checkpoint_id=m.checkpoint_id
            )
    except BaseException as exc:
        with contextlib.suppress(BelayerError):
            await asyncio.to_thread(docker.remove, cid)
        if isinstance(exc, BelayerError) and not await asyncio.to_thread(docker.reachable):
            raise NotTheCheckpoint(exc) from None
        raise
    return cid


def start_restoring(docker: DockerOps, config: EnvConfig, cid: str, images: Path) -> None:
    """``docker start`` a container of the restore runtime with a restore marker: the runtime's
    ``create`` is ``runc restore`` from ``images``. Blocking; the marker files go either way."""
    markers = config.restore_marker_dir
    work = markers / f"{cid}.work"
    (markers / f"{cid}.restore").write_text(f"{images}\n")
    try:
        docker.start(cid)
    except SandboxError as exc:
        errors = ops.criu_errors(work / "restore.log")
        message = exc.message.split("\nlog file:", 1)[0]  # the log goes with the work dir
        raise SandboxError(
            f"{message}{'; criu: ' + errors if errors else ''}", **exc.data
        ) from None
    finally:
        clear_markers(config, cid)


def clear_markers(config: EnvConfig, cid: str) -> None:
    """Remove a container's restore marker files (a killed service can leave them)."""
    markers = config.restore_marker_dir
    for name in (f"{cid}.restore", f"{cid}.restored"):
        (markers / name).unlink(missing_ok=True)
    ops.remove_tree(markers / f"{cid}.work")


def restore_method(config: EnvConfig, docker: DockerOps, shipped: Path) -> str:
    """``runtime`` when dockerd has ``restore_runtime`` registered and its binary is the wrapper
    this service ships (``shipped``; a stale or foreign one is not trusted), else ``docker``.
    ``restore_method="runtime"`` makes a missing runtime an error."""
    if config.restore_method == "docker":
        return "docker"
    entry = docker.runtimes().get(config.restore_runtime) or {}
    path = shutil.which(str(entry.get("path", ""))) if entry else None
    try:
        same = path is not None and Path(path).read_bytes() == shipped.read_bytes()
    except OSError:
        same = False
    if same:
        config.restore_marker_dir.mkdir(parents=True, exist_ok=True)
        return "runtime"
    if config.restore_method == "runtime":
        raise SandboxError(
            "the restore runtime is not registered with dockerd (run deploy/install_env.sh)",
            runtime=config.restore_runtime,
        )
    return "docker"


def checkpoint_info(
    m: Manifest, *, container_exited: bool = False, manifest_sha256: str = ""
) -> CheckpointInfo:
    d = m.durations
    return CheckpointInfo(
        sandbox_id=m.sandbox_id,
        trajectory_id=m.trajectory_id,
        prefix=m.prefix,
        checkpoint_id=m.checkpoint_id,
        fs_bytes=m.fs_bytes,
        criu_bytes=m.criu_bytes,
        freeze_s=d.get("freeze_s", 0.0),
        fs_s=d.get("fs_s", 0.0),
        dump_s=d.get("dump_s", 0.0),
        total_s=d.get("total_s", 0.0),
        method=m.method,
        container_exited=container_exited,
        digests={core.FS_ARCHIVE: m.fs_sha256}
        | {f"{core.CRIU_DIR}/{k}": v for k, v in m.criu_sha256.items()},
        manifest_sha256=manifest_sha256,
    )


def unreadable_manifest(sandbox_id: str, name: str) -> Manifest:
    """Placeholder for a checkpoint whose manifest cannot be read (rejected at restore).
    Its prefix comes from the id (``…-k000042-…``) so fallback order still works."""
    try:
        prefix = int(name.rsplit("-k", 1)[1].split("-")[0])
    except (IndexError, ValueError):
        prefix = -1
    return Manifest(
        sandbox_id=sandbox_id,
        trajectory_id="",
        prefix=prefix,
        checkpoint_id=name,
        image="",
        created_at=0.0,
        fs_bytes=0,
        fs_sha256="",
        criu_bytes=0,
        criu_files={},
        method="unreadable",
    )
