"""Pure core of the environment service: sandbox records and their state machine, the
checkpoint manifest and directory layout, and the choice of the checkpoint to restore.
No Docker, no CRIU, no NATS here (see ``docker_ops``/``criu_ops``/``service``).

Checkpoint layout (one directory per checkpoint, written under a temp name, renamed whole)::

    <checkpoint_root>/<sandbox_id>/<checkpoint_id>/
        manifest.json      sandbox, trajectory, prefix k, image, sizes, sha256 of fs.tar and
                           of every CRIU image (its own sha256 is in the KV ready pointer)
        fs.tar             the container's overlay upper dir (whiteouts and xattrs kept)
        criu/              CRIU images of the process tree (runc or Docker's checkpoint)
    <checkpoint_root>/<sandbox_id>/.tmp-<checkpoint_id>/   in progress; never used, deleted
    <checkpoint_root>/<sandbox_id>/.quarantine-<checkpoint_id>/   failed to restore once: set
        aside for inspection, never counted, listed or tried again (deleted with the sandbox)
"""

from __future__ import annotations

import enum
import hashlib
import math
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec

from common.errors import CheckpointInvalid, Conflict, InvalidRequest, SandboxError
from common.subjects import check_token

MANIFEST = "manifest.json"
FS_ARCHIVE = "fs.tar"
CRIU_DIR = "criu"
TMP_PREFIX = ".tmp-"
QUARANTINE_PREFIX = ".quarantine-"
MANIFEST_VERSION = 2
"""2: ``criu_sha256`` (every CRIU image's digest) is required."""


class SandboxState(enum.Enum):
    """Lifecycle of one sandbox."""

    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    RESTORING = "restoring"
    FAILED = "failed"
    """The container died or a restore failed; ``full_restore`` may bring it back."""
    DESTROYED = "destroyed"


_ALLOWED: dict[SandboxState, set[SandboxState]] = {
    SandboxState.RUNNING: {
        SandboxState.CHECKPOINTING,
        SandboxState.RESTORING,
        SandboxState.FAILED,
        SandboxState.DESTROYED,
    },
    SandboxState.CHECKPOINTING: {SandboxState.RUNNING, SandboxState.FAILED},
    SandboxState.RESTORING: {SandboxState.RUNNING, SandboxState.FAILED},
    SandboxState.FAILED: {SandboxState.RESTORING, SandboxState.DESTROYED, SandboxState.RUNNING},
    SandboxState.DESTROYED: set(),
}


def check_transition(old: SandboxState, new: SandboxState) -> None:
    """Raise ``Conflict`` unless ``old → new`` is a legal step."""
    if new not in _ALLOWED[old]:
        raise Conflict(f"sandbox cannot go from {old.value} to {new.value}")


class Limits(msgspec.Struct, kw_only=True):
    memory_mb: int
    cpus: float
    pids: int


def check_limits(limits: Limits, maximum: Limits) -> Limits:
    """``limits`` if every one is positive, finite and at most ``maximum``'s (the service's
    configured caps); else ``InvalidRequest`` naming the field. A zero or negative Docker limit
    would mean *no* limit, so none gets through (the schema refuses them too)."""
    for name in ("memory_mb", "cpus", "pids"):
        value, most = getattr(limits, name), getattr(maximum, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= most):
            raise InvalidRequest(
                f"limits.{name} must be in (0, {most}]", field=f"$.limits.{name}", max=most
            )
    if int(limits.cpus * 1e9) < 10_000_000:  # Docker's floor, 0.01 core; NanoCpus 0 = no limit
        raise InvalidRequest("limits.cpus must be at least 0.01", field="$.limits.cpus", min=0.01)
    return limits


class SandboxRecord(msgspec.Struct, kw_only=True):
    """What the service remembers about a sandbox (persisted as JSON next to the checkpoints,
    so a restarted service re-adopts its sandboxes)."""

    id: str
    image: str
    container_id: str
    limits: Limits
    trajectory_id: str = ""
    state: str = SandboxState.RUNNING.value
    created_at: float = 0.0
    ready_prefix: int | None = None
    checkpoint_id: str | None = None
    cooldown_until: float = 0.0
    restores: int = 0
    verified_checkpoint_id: str | None = None
    """The newest checkpoint that restored successfully (the last good state): pruning never
    removes it."""

    @property
    def status(self) -> SandboxState:
        return SandboxState(self.state)

    def move(self, new: SandboxState) -> None:
        check_transition(self.status, new)
        self.state = new.value


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(6)


def validate_sandbox_id(value: str) -> str:
    try:
        return check_token(value, "sandbox id")
    except ValueError as exc:
        raise InvalidRequest(str(exc), field="sandbox_id") from None


def checkpoint_id_for(sandbox_id: str, prefix: int) -> str:
    """Unique, subject-safe, sortable by prefix: ``<sandbox>-k<000042>-<random>``."""
    return f"{sandbox_id}-k{prefix:06d}-{secrets.token_hex(3)}"


class Manifest(msgspec.Struct, kw_only=True):
    """``manifest.json`` of one checkpoint; restore validates it before using anything else."""

    version: int = MANIFEST_VERSION
    sandbox_id: str
    trajectory_id: str
    prefix: int
    checkpoint_id: str
    image: str
    created_at: float
    fs_bytes: int
    fs_sha256: str
    criu_bytes: int
    criu_files: dict[str, int]
    """File name → size of every CRIU image."""
    criu_sha256: dict[str, str] = {}
    """File name → SHA-256 of every CRIU image."""
    method: str
    durations: dict[str, float] = {}


def write_manifest(directory: Path, manifest: Manifest) -> None:
    (directory / MANIFEST).write_bytes(msgspec.json.encode(manifest))


def read_manifest(directory: Path) -> Manifest:
    try:
        return msgspec.json.decode((directory / MANIFEST).read_bytes(), type=Manifest)
    except FileNotFoundError:
        raise CheckpointInvalid("checkpoint has no manifest", path=str(directory)) from None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointInvalid("checkpoint manifest is corrupt", error=str(exc)) from None


def check_manifest(manifest: Manifest, *, sandbox_id: str, checkpoint_id: str) -> None:
    """The manifest must belong to this sandbox and name itself."""
    if manifest.version != MANIFEST_VERSION:
        raise CheckpointInvalid("unsupported manifest version", version=manifest.version)
    if manifest.sandbox_id != sandbox_id:
        raise Conflict(
            "checkpoint belongs to another sandbox",
            checkpoint_id=checkpoint_id,
            owner=manifest.sandbox_id,
            sandbox_id=sandbox_id,
        )
    if manifest.checkpoint_id != checkpoint_id:
        raise CheckpointInvalid("manifest names another checkpoint", checkpoint_id=checkpoint_id)


def manifest_digest(directory: Path) -> str:
    """SHA-256 of a checkpoint's ``manifest.json`` bytes (recorded in the ready pointer)."""
    try:
        return hashlib.sha256((directory / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        raise CheckpointInvalid("checkpoint has no manifest", path=str(directory)) from None


def check_manifest_digest(checkpoint_id: str, actual: str, recorded: dict[str, str] | None) -> None:
    """A checkpoint restores only if the ready pointer lists it with this manifest digest
    (``recorded`` is ``None`` when there is no pointer to compare with)."""
    if recorded is None:
        return
    want = recorded.get(checkpoint_id)
    if want is None:
        raise CheckpointInvalid(
            "checkpoint is not a recorded ready checkpoint (substituted?)",
            checkpoint_id=checkpoint_id,
        )
    if want != actual:
        raise CheckpointInvalid(
            "checkpoint manifest digest mismatch (modified)", checkpoint_id=checkpoint_id
        )


def carry_manifests(
    previous: dict[str, str], existing: set[str], checkpoint_id: str, digest: str
) -> dict[str, str]:
    """The ready pointer's ``manifests`` once ``checkpoint_id`` is ready: the previous entries
    whose checkpoints still exist (``existing``, bounded by pruning) plus the new one."""
    out = {k: v for k, v in previous.items() if k in existing}
    out[checkpoint_id] = digest
    return out


def check_criu_files(directory: Path, manifest: Manifest) -> None:
    """Every CRIU image listed in the manifest exists with its recorded size and has a
    recorded digest (the digests themselves are checked by whoever reads the bytes)."""
    criu = directory / CRIU_DIR
    if not manifest.criu_files:
        raise CheckpointInvalid("checkpoint has no process images")
    if set(manifest.criu_sha256) != set(manifest.criu_files):
        raise CheckpointInvalid("checkpoint lacks a digest of every CRIU image")
    for name, size in manifest.criu_files.items():
        if "/" in name or name.startswith("."):
            raise CheckpointInvalid("bad CRIU image name", name=name)
        try:
            actual = (criu / name).stat().st_size
        except OSError:
            raise CheckpointInvalid("CRIU image missing", name=name) from None
        if actual != size:
            raise CheckpointInvalid("CRIU image has the wrong size", name=name, size=actual)


def restore_candidates(
    available: list[Manifest],
    *,
    ready_checkpoint_id: str | None,
    requested: str | None,
    ready_prefix: int | None = None,
) -> list[Manifest]:
    """Checkpoints to try, in order. A requested one alone; otherwise the ready one, then the
    older ones by decreasing prefix (the fallback when the newest fails). When the ready one is
    gone (quarantined after a failed restore), the ones older than its ``ready_prefix``.
    Checkpoints newer than the ready pointer were never published and are never used."""
    if requested:
        chosen = [m for m in available if m.checkpoint_id == requested]
        return chosen
    ordered = sorted(available, key=lambda m: (m.prefix, m.created_at), reverse=True)
    if ready_checkpoint_id is None:
        return []
    ready = next((m for m in ordered if m.checkpoint_id == ready_checkpoint_id), None)
    if ready is None:
        if ready_prefix is None:
            return []
        return [m for m in ordered if m.prefix < ready_prefix]
    return [ready] + [m for m in ordered if m.prefix < ready.prefix]


def prune_plan(available: list[Manifest], keep: int, protected: set[str]) -> list[str]:
    """Checkpoint ids to delete: all but the newest ``keep`` (at least 1) and the
    ``protected`` ones (the ready one, the last one that restored)."""
    ordered = sorted(available, key=lambda m: (m.prefix, m.created_at), reverse=True)
    return [m.checkpoint_id for m in ordered[max(1, keep) :] if m.checkpoint_id not in protected]


def to_jsonable(record: SandboxRecord) -> dict[str, Any]:
    return msgspec.to_builtins(record)


def save_record(directory: Path, record: SandboxRecord) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{record.id}.json.tmp"
    tmp.write_bytes(msgspec.json.encode(record))
    tmp.replace(directory / f"{record.id}.json")


def load_records(directory: Path) -> list[SandboxRecord]:
    out: list[SandboxRecord] = []
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*.json")):
        try:
            out.append(msgspec.json.decode(path.read_bytes(), type=SandboxRecord))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            path.unlink(missing_ok=True)
    return out


def remove_record(directory: Path, sandbox_id: str) -> None:
    (directory / f"{sandbox_id}.json").unlink(missing_ok=True)


class Deadline:
    """A monotonic deadline; ``left()`` raises ``SandboxError`` subclasses via the caller."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end


_ = SandboxError
