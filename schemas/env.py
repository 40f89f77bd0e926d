"""Messages of the environment service (``belayer.env.<op>``) and its ``checkpoint_ready`` event.

Requests and replies are typed, versioned structs (MessagePack on the wire). Sandboxes are
identified by a subject-safe ``sandbox_id``; checkpoints by ``checkpoint_id`` (``<sandbox>-k<k>-…``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from schemas.base import Id, IdOrEmpty, Message

SandboxId = Id
"""Sandbox id: a subject-safe token (``schemas.base.Id``); also a directory name."""

TrajectoryId = Id
"""Trajectory id (``schemas.base.Id``)."""

MAX_PREFIX = 999_999_999
"""Largest action-boundary index k (9 digits in a checkpoint id)."""

CheckpointId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,160}\Z")]
"""Checkpoint id, ``<sandbox_id>-k<prefix, 6+ digits>-<6 hex>``: the ``Id`` characters, at
most 160 of them (a directory name)."""

CheckpointIdOrEmpty = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{0,160}\Z")]
"""A ``CheckpointId`` or ``""``."""

TimeoutSeconds = Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)]
"""A deadline in seconds, finite, at most a day (0: the service's default). The service may
cap it lower (``EnvConfig.exec_timeout_max_s``)."""


class SandboxLimits(msgspec.Struct, kw_only=True):
    """Resource limits of one sandbox (Docker's pids/memory/CPU cgroup limits). Every limit is
    positive and finite (no value switches a limit off); the service also caps each one by its
    configured maximum (``EnvConfig.max_memory_mb``, ``max_cpus``, ``max_pids``)."""

    memory_mb: Annotated[int, msgspec.Meta(ge=6, le=1_048_576)] = 512
    """Memory limit in MiB (no swap beyond it); Docker's minimum is 6."""
    cpus: Annotated[float, msgspec.Meta(ge=0.01, le=1024.0)] = 1.0
    """CPU quota in cores; Docker's granularity is 0.01."""
    pids: Annotated[int, msgspec.Meta(ge=1, le=4_194_304)] = 256
    """Maximum number of processes/threads."""


class TaskFile(msgspec.Struct, kw_only=True):
    """A file written into the sandbox at creation (task inputs, scripts)."""

    path: str
    """Absolute path inside the sandbox."""
    content: bytes
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o7777)] = 0o644


class EnvCreate(Message, tag="EnvCreate.v1"):
    """Create a sandbox from ``image`` (default: the service's base image)."""

    image: str = ""
    files: list[TaskFile] = []
    limits: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    trajectory_id: IdOrEmpty = ""
    """Trajectory this sandbox serves (stamped on its checkpoints and events)."""
    sandbox_id: IdOrEmpty = ""
    """Optional caller-chosen id (subject-safe); default: a fresh random id."""


class EnvCreated(Message, tag="EnvCreated.v1"):
    """Reply to ``EnvCreate``."""

    sandbox_id: SandboxId
    container_id: Id
    image: str
    duration_s: float = 0.0


class EnvExec(Message, tag="EnvExec.v1"):
    """Run ``command`` (``sh -c``) in the sandbox; killed after ``timeout_s``."""

    sandbox_id: SandboxId
    command: str
    timeout_s: TimeoutSeconds = 30.0
    workdir: str = ""


class EnvExecResult(Message, tag="EnvExecResult.v1"):
    """Reply to ``EnvExec``. Output beyond the service's cap is dropped (``truncated``)."""

    sandbox_id: SandboxId
    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    truncated: bool = False
    timed_out: bool = False


class EnvCheckpoint(Message, tag="EnvCheckpoint.v1"):
    """``full_checkpoint``: capture files + processes at action boundary ``prefix``."""

    sandbox_id: SandboxId
    prefix: Annotated[int, msgspec.Meta(ge=0, le=MAX_PREFIX)]
    """Action-boundary index k the checkpoint belongs to (must exceed the ready one)."""
    trajectory_id: IdOrEmpty = ""
    timeout_s: TimeoutSeconds = 0.0
    """0: the service's default checkpoint timeout."""


class CheckpointInfo(Message, tag="CheckpointInfo.v1"):
    """A ready checkpoint (reply to ``EnvCheckpoint``; also the ``checkpoint_ready`` data)."""

    sandbox_id: SandboxId
    trajectory_id: IdOrEmpty
    prefix: int
    checkpoint_id: CheckpointId
    fs_bytes: int
    """Size of the writable-layer archive."""
    criu_bytes: int
    """Size of the CRIU images."""
    freeze_s: float
    """Time the container stayed frozen."""
    fs_s: float
    """Time to archive the writable layer."""
    dump_s: float
    """Time to dump the processes."""
    total_s: float
    method: str = "runc"
    """``runc`` (CRIU through runc on the Docker-managed container), ``docker``, or ``layer``
    (the writable layer alone: the sandbox was quiescent — no process but its init, ``/dev``,
    ``/dev/shm``, ``/dev/mqueue`` and System V IPC as in a fresh container — so its process
    state is a fresh container's; ``criu_bytes`` is 0)."""
    container_exited: bool = False
    """The container died during the checkpoint, after the dump had completed: the checkpoint
    is complete and ready, the sandbox is ``failed`` (restore it). A death before the dump
    completed answers ``SandboxError`` with ``dump_completed=False`` instead."""
    digests: dict[str, str] = {}
    """SHA-256 of every artifact: ``fs.tar`` and ``criu/<image>`` (what restore verifies)."""
    manifest_sha256: str = ""
    """SHA-256 of ``manifest.json`` (which lists ``digests``); the ready pointer records it."""


class EnvRestore(Message, tag="EnvRestore.v1"):
    """``full_restore``: roll the sandbox back to a ready checkpoint in a fresh container."""

    sandbox_id: SandboxId
    checkpoint_id: CheckpointIdOrEmpty = ""
    """Empty: the latest ready checkpoint."""
    from_store: bool = False
    """The sandbox lived on another (dead) environment host: fetch ``checkpoint_id`` from the
    checkpoint object store and take the sandbox over here (``image``, ``limits`` and
    ``trajectory_id`` describe it; the ready pointer's digests verify the checkpoint)."""
    image: str = ""
    limits: SandboxLimits | None = None
    trajectory_id: IdOrEmpty = ""


class RestoreAttempt(msgspec.Struct, kw_only=True):
    """What one ``full_restore`` did with one candidate checkpoint."""

    checkpoint_id: CheckpointId
    prefix: int
    outcome: str
    """``restored`` (restored into a fresh container, checked running, now the sandbox's),
    ``quarantined`` (failed to restore now: set aside, never counted or tried again) or
    ``skipped`` (quarantined by an earlier restore)."""
    error: str = ""
    """Why it failed (``quarantined``/``skipped``)."""


class EnvRestored(Message, tag="EnvRestored.v1"):
    """Reply to ``EnvRestore``."""

    sandbox_id: SandboxId
    container_id: Id
    checkpoint_id: CheckpointId
    prefix: int
    duration_s: float
    method: str = "docker"
    """``runtime`` (runc restore under containerd's shim through the ``belayer`` OCI runtime),
    ``docker`` (Docker's checkpoint import) or ``layer`` (a layer-only checkpoint: a fresh
    container from the image with the layer installed)."""
    fallback_from: str = ""
    """The checkpoints (comma-separated) passed over before this one was used: rejected now or
    quarantined by an earlier restore."""
    candidates: list[RestoreAttempt] = []
    """Every candidate considered, in order, with what happened to it."""


class EnvDestroy(Message, tag="EnvDestroy.v1"):
    """Remove the sandbox, its container and all its checkpoints."""

    sandbox_id: SandboxId


class EnvGc(Message, tag="EnvGc.v1"):
    """Drop the checkpoints of a finished trajectory (its sandboxes stay)."""

    trajectory_id: TrajectoryId


class EnvList(Message, tag="EnvList.v1"):
    """List the sandboxes of this service."""


class SandboxInfo(msgspec.Struct, kw_only=True):
    """One sandbox as ``env ls`` shows it."""

    id: SandboxId
    container_id: IdOrEmpty
    image: str
    state: str
    trajectory_id: IdOrEmpty = ""
    ready_prefix: int | None = None
    checkpoint_id: CheckpointId | None = None
    checkpoints: int = 0
    cooldown_until: float = 0.0


class EnvListing(Message, tag="EnvListing.v1"):
    """Reply to ``EnvList``."""

    sandboxes: list[SandboxInfo]


class ReadyPointer(msgspec.Struct, kw_only=True):
    """Value of the ``sandbox_prefix`` KV entry (key: the sandbox id)."""

    sandbox_id: SandboxId
    prefix: int
    checkpoint_id: CheckpointId
    trajectory_id: IdOrEmpty = ""
    ts: float = 0.0
    manifests: dict[CheckpointId, str] = {}
    """Checkpoint id → SHA-256 of its ``manifest.json``, for the ready checkpoint and the older
    ones still kept. Restore refuses a checkpoint not listed here or whose manifest (and so
    whose artifacts' digests) changed: a modified, truncated or substituted checkpoint."""


class EnvPing(Message, tag="EnvPing.v1"):
    """Liveness of one environment host (``belayer.envhost.<host>.ping``)."""


class EnvHostInfo(Message, tag="EnvHostInfo.v1"):
    """An environment host's registration (KV ``env_hosts``, key: ``host``) and its answer to
    ``ping``: what the controller places sandboxes by."""

    host: Id
    capacity: int
    """Most live sandboxes it takes (``EnvConfig.max_sandboxes``)."""
    sandboxes: int
    """Live sandboxes now."""
    sandbox_ids: list[Id] = []
    """Their ids (how a restarted controller finds the host of a sandbox)."""
    ts: float = 0.0
    """When it wrote this (seconds since the epoch)."""
    boot: str = ""
    """A random id of the service process that answers (new at each start): a ping that
    answers with another one means the host restarted, and what its previous process had in
    flight will never be answered."""


EnvRequest = EnvCreate | EnvExec | EnvCheckpoint | EnvRestore | EnvDestroy | EnvList | EnvGc
