"""One checkpoint's I/O, apart from the manager's orchestration (locks, pointers, fallback):
``capture`` freezes a container and writes its file-system layer and process images into a
checkpoint directory; ``restore_one`` validates one checkpoint and rebuilds a fresh container
from it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from common.errors import CheckpointInvalid, SandboxError
from schemas.env import CheckpointInfo
from services.environment import core
from services.environment import criu_ops as ops
from services.environment.archive import validate_archive
from services.environment.config import EnvConfig
from services.environment.core import Manifest, SandboxRecord, SandboxState
from services.environment.docker_ops import DockerOps


async def capture(
    docker: DockerOps,
    config: EnvConfig,
    rec: SandboxRecord,
    tmp: Path,
    ck_id: str,
    prefix: int,
    trajectory_id: str,
) -> Manifest:
    """Freeze → archive the upper dir → dump processes → thaw → hash → manifest → fsync."""
    info = await asyncio.to_thread(docker.inspect, rec.container_id)
    if not info["State"]["Running"]:
        rec.move(SandboxState.FAILED)
        raise SandboxError("sandbox's container is not running", sandbox_id=rec.id)
    pid = int(info["State"]["Pid"])
    upper = str(info["GraphDriver"]["Data"]["UpperDir"])
    method = checkpoint_method(config, rec.container_id)
    control = ops.freezer_path(pid)
    if control is None:
        raise SandboxError("cannot find the container's freezer cgroup", sandbox_id=rec.id)
    t0 = time.monotonic()
    await ops.freeze(control)
    try:
        t1 = time.monotonic()
        fs_bytes = await ops.archive_layer(upper, tmp / core.FS_ARCHIVE, timeout=60.0)
        t2 = time.monotonic()
        if method == "runc":
            await ops.runc_checkpoint(
                config.runc_bin,
                config.runc_root,
                rec.container_id,
                tmp / core.CRIU_DIR,
                tmp / "work",
                timeout=max(1.0, config.checkpoint_timeout_s),
            )
        else:
            await asyncio.to_thread(
                docker.checkpoint_create, rec.container_id, core.CRIU_DIR, str(tmp)
            )
        t3 = time.monotonic()
    finally:
        ops.thaw(control)
    t4 = time.monotonic()
    ops.remove_tree(tmp / "work")
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
        method=method,
        durations={"freeze_s": t4 - t0, "fs_s": t2 - t1, "dump_s": t3 - t2},
    )
    manifest.criu_bytes = sum(manifest.criu_files.values())
    core.write_manifest(tmp, manifest)
    if config.fsync:
        await asyncio.to_thread(ops.fsync_tree, tmp, skip_pages=not config.fsync_page_images)
    return manifest


def checkpoint_method(config: EnvConfig, container_id: str) -> str:
    """``runc`` (CRIU through runc on the Docker-managed container) when runc knows the
    container, else Docker's checkpoint API (or whatever the config forces)."""
    m = config.checkpoint_method
    if m == "docker":
        return "docker"
    if ops.runc_knows(config.runc_root, container_id):
        return "runc"
    if m == "runc":
        raise SandboxError("runc does not know the container", runc_root=str(config.runc_root))
    return "docker"


async def restore_one(
    docker: DockerOps, config: EnvConfig, rec: SandboxRecord, d: Path, m: Manifest
) -> str:
    """Validate one checkpoint, then fresh container ← layer ← processes."""
    if m.method == "unreadable":
        raise CheckpointInvalid("checkpoint manifest is corrupt", checkpoint_id=m.checkpoint_id)
    core.check_manifest(m, sandbox_id=rec.id, checkpoint_id=d.name)
    core.check_criu_files(d, m)
    archive = d / core.FS_ARCHIVE
    validate_archive(archive, config.archive_limits)
    digest = await asyncio.to_thread(ops.sha256_file, archive)
    if digest != m.fs_sha256:
        raise CheckpointInvalid(
            "file-system archive checksum mismatch", checkpoint_id=m.checkpoint_id
        )
    cid = await asyncio.to_thread(docker.create, rec.id, m.image or rec.image, rec.limits)
    try:
        upper = await asyncio.to_thread(docker.upper_dir, cid)
        await ops.install_layer(archive, upper, timeout=120.0)
        cdir = Path(await asyncio.to_thread(docker.container_dir, cid))
        name = "belayer-" + m.checkpoint_id[-16:]
        ops.link_or_copy_tree(d / core.CRIU_DIR, cdir / "checkpoints" / name)
        await asyncio.to_thread(docker.start, cid, name)
    except BaseException:
        await asyncio.to_thread(docker.remove, cid)
        raise
    return cid


def checkpoint_info(m: Manifest) -> CheckpointInfo:
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
