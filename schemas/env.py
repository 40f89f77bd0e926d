"""Messages of the environment service (``belayer.env.<op>``) and its ``checkpoint_ready`` event.

Requests and replies are typed, versioned structs (MessagePack on the wire). Sandboxes are
identified by a subject-safe ``sandbox_id``; checkpoints by ``checkpoint_id`` (``<sandbox>-k<k>-…``).
"""

from __future__ import annotations

import msgspec

from schemas.base import Message


class SandboxLimits(msgspec.Struct, kw_only=True):
    """Resource limits of one sandbox (Docker's pids/memory/CPU cgroup limits)."""

    memory_mb: int = 512
    """Memory limit in MiB (no swap beyond it)."""
    cpus: float = 1.0
    """CPU quota in cores."""
    pids: int = 256
    """Maximum number of processes/threads."""


class TaskFile(msgspec.Struct, kw_only=True):
    """A file written into the sandbox at creation (task inputs, scripts)."""

    path: str
    """Absolute path inside the sandbox."""
    content: bytes
    mode: int = 0o644


class EnvCreate(Message, tag="EnvCreate.v1"):
    """Create a sandbox from ``image`` (default: the service's base image)."""

    image: str = ""
    files: list[TaskFile] = []
    limits: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    trajectory_id: str = ""
    """Trajectory this sandbox serves (stamped on its checkpoints and events)."""
    sandbox_id: str = ""
    """Optional caller-chosen id (subject-safe); default: a fresh random id."""


class EnvCreated(Message, tag="EnvCreated.v1"):
    """Reply to ``EnvCreate``."""

    sandbox_id: str
    container_id: str
    image: str
    duration_s: float = 0.0


class EnvExec(Message, tag="EnvExec.v1"):
    """Run ``command`` (``sh -c``) in the sandbox; killed after ``timeout_s``."""

    sandbox_id: str
    command: str
    timeout_s: float = 30.0
    workdir: str = ""


class EnvExecResult(Message, tag="EnvExecResult.v1"):
    """Reply to ``EnvExec``. Output beyond the service's cap is dropped (``truncated``)."""

    sandbox_id: str
    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    truncated: bool = False
    timed_out: bool = False


class EnvCheckpoint(Message, tag="EnvCheckpoint.v1"):
    """``full_checkpoint``: capture files + processes at action boundary ``prefix``."""

    sandbox_id: str
    prefix: int
    """Action-boundary index k the checkpoint belongs to (must exceed the ready one)."""
    trajectory_id: str = ""
    timeout_s: float = 0.0
    """0: the service's default checkpoint timeout."""


class CheckpointInfo(Message, tag="CheckpointInfo.v1"):
    """A ready checkpoint (reply to ``EnvCheckpoint``; also the ``checkpoint_ready`` data)."""

    sandbox_id: str
    trajectory_id: str
    prefix: int
    checkpoint_id: str
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
    """``runc`` (CRIU through runc on the Docker-managed container) or ``docker``."""


class EnvRestore(Message, tag="EnvRestore.v1"):
    """``full_restore``: roll the sandbox back to a ready checkpoint in a fresh container."""

    sandbox_id: str
    checkpoint_id: str = ""
    """Empty: the latest ready checkpoint."""


class EnvRestored(Message, tag="EnvRestored.v1"):
    """Reply to ``EnvRestore``."""

    sandbox_id: str
    container_id: str
    checkpoint_id: str
    prefix: int
    duration_s: float
    method: str = "docker"
    fallback_from: str = ""
    """A checkpoint that was rejected (corrupt/hostile) before this one was used."""


class EnvDestroy(Message, tag="EnvDestroy.v1"):
    """Remove the sandbox, its container and all its checkpoints."""

    sandbox_id: str


class EnvGc(Message, tag="EnvGc.v1"):
    """Drop the checkpoints of a finished trajectory (its sandboxes stay)."""

    trajectory_id: str


class EnvList(Message, tag="EnvList.v1"):
    """List the sandboxes of this service."""


class SandboxInfo(msgspec.Struct, kw_only=True):
    """One sandbox as ``env ls`` shows it."""

    id: str
    container_id: str
    image: str
    state: str
    trajectory_id: str = ""
    ready_prefix: int | None = None
    checkpoint_id: str | None = None
    checkpoints: int = 0
    cooldown_until: float = 0.0


class EnvListing(Message, tag="EnvListing.v1"):
    """Reply to ``EnvList``."""

    sandboxes: list[SandboxInfo]


class ReadyPointer(msgspec.Struct, kw_only=True):
    """Value of the ``sandbox_prefix`` KV entry (key: the sandbox id)."""

    sandbox_id: str
    prefix: int
    checkpoint_id: str
    trajectory_id: str = ""
    ts: float = 0.0


EnvRequest = EnvCreate | EnvExec | EnvCheckpoint | EnvRestore | EnvDestroy | EnvList | EnvGc
