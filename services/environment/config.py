"""Configuration of the environment service: one frozen dataclass, every field documented."""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.service import ServiceConfig
from services.environment.archive import ArchiveLimits


def _node_name() -> str:
    host = socket.gethostname() or "node"
    return "".join(c if c.isalnum() or c in "_-" else "-" for c in host)[:64]


@dataclass(frozen=True)
class EnvConfig(ServiceConfig):
    """Everything the environment service needs; loaded once in ``__main__``."""

    run_dir: Path = Path(".belayer")
    """Checkpoints live in ``<run_dir>/env/checkpoints``, sandbox records in ``<run_dir>/env/sandboxes``."""
    image: str = "belayer-sandbox:1"
    """Default sandbox image (built locally by ``deploy/install_env.sh``)."""
    node: str = field(default_factory=_node_name)
    """Value of the ``belayer.node`` container label; containers of this node with no live
    sandbox are reaped at start."""
    docker_url: str = "unix:///var/run/docker.sock"
    """dockerd's API socket."""
    docker_timeout_s: float = 30.0
    """Timeout of one Docker API call."""
    runc_root: Path = Path("/run/docker/runtime-runc/moby")
    """runc's state directory for Docker-managed containers (Docker 20.10 + containerd)."""
    runc_bin: str = "runc"
    """runc binary (the one containerd uses)."""
    checkpoint_method: Literal["auto", "runc", "docker"] = "auto"
    """``runc`` (CRIU through runc on the Docker-managed container; fast), ``docker`` (Docker's
    checkpoint API; ~20× slower for memory-heavy sandboxes) or ``auto`` (runc, falling back to
    Docker when runc cannot see the container)."""
    restore_method: Literal["auto", "runtime", "docker"] = "auto"
    """``runtime`` (the restore container runs under the ``restore_runtime`` OCI runtime, whose
    ``create`` is ``runc restore`` from the checkpoint's images: CRIU + ~0.2 s), ``docker``
    (Docker's ``start --checkpoint``: images copied through containerd's content store, ~5×
    slower for a 256 MB process) or ``auto`` (``runtime`` when dockerd has it registered, with
    the wrapper this service ships, else ``docker``)."""
    restore_runtime: str = "belayer"
    """Name of the OCI runtime registered with dockerd (``deploy/install_env.sh`` installs
    ``services/environment/belayer-runc`` and registers it)."""
    restore_marker_dir: Path = Path("/run/belayer-restore")
    """Where restore markers for the ``belayer`` runtime live (the wrapper's ``MARKERS``)."""
    quarantine_keep: int = 3
    """Quarantined checkpoints (failed to restore) kept per sandbox for inspection; older ones
    are deleted."""
    checkpoint_timeout_s: float = 60.0
    """Default deadline of one ``full_checkpoint``."""
    restore_timeout_s: float = 120.0
    """Deadline of one ``full_restore``."""
    cooldown_s: float = 20.0
    """Checkpointing of a sandbox stays disabled this long after one of its checkpoints timed out."""
    keep_checkpoints: int = 3
    """Ready checkpoints kept per sandbox (older ones are deleted when a new one is ready)."""
    exec_timeout_s: float = 30.0
    """Default ``exec`` timeout."""
    exec_timeout_max_s: float = 3600.0
    """Largest ``exec`` timeout accepted."""
    exec_output_cap: int = 256 * 1024
    """Bytes kept of each of stdout and stderr (the rest is dropped, ``truncated`` is set)."""
    lock_wait_s: float = 30.0
    """How long exec/checkpoint wait for the sandbox's lock before answering ``CheckpointBusy``."""
    docker_race_retries: int = 3
    """Retries of Docker's checkpoint race (moby#42900: ``content sha256:… already exists``)."""
    docker_race_delay_s: float = 0.3
    """Pause before each such retry."""
    archive_limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    """Caps enforced on a writable-layer archive before it is installed."""
    max_sandboxes: int = 64
    """Refuse ``create`` beyond this many live sandboxes (this host's capacity, registered
    in KV ``env_hosts`` for the controller's placement)."""
    register_every_s: float = 2.0
    """How often this host refreshes its registration (also at once when its number of
    sandboxes changes)."""
    checkpoint_store: bool = False
    """Also store every ready checkpoint in the JetStream Object Store ``checkpoints`` (before
    it is published), so another host can restore the sandbox when this one dies. On for
    environment hosts and nodes that join a deployment (``belayer up --join``)."""
    default_memory_mb: int = 512
    """Default memory limit of a sandbox."""
    default_cpus: float = 1.0
    """Default CPU quota (cores)."""
    default_pids: int = 256
    """Default pids limit."""
    max_memory_mb: int = 16_384
    """Largest memory limit (MiB) a ``create`` may ask for; above it: ``invalid_request``."""
    max_cpus: float = field(default_factory=lambda: float(os.cpu_count() or 1))
    """Largest CPU quota (cores) a ``create`` may ask for (default: this machine's CPUs)."""
    max_pids: int = 4096
    """Largest pids limit a ``create`` may ask for."""
    layer_only_when_quiescent: bool = True
    """Checkpoint a quiescent sandbox — its only processes init and init's ``sleep``; ``/dev``,
    ``/dev/shm``, ``/dev/mqueue`` and System V IPC as in a fresh container — as its writable
    layer alone (method ``layer``), without CRIU: its process state is a fresh container's,
    which a restore starts. About a tenth of a CRIU dump's CPU. Off: always dump with CRIU."""
    fsync: bool = True
    """fsync checkpoint files and directories before publishing them."""
    fsync_page_images: bool = False
    """Also fsync CRIU's memory page images. Off by default: they are most of a checkpoint's
    bytes (fsync doubles a 256 MB checkpoint's cost) and only a machine crash — outside the
    failure model — could lose them; a torn image set then fails restore and the previous
    ready checkpoint is used."""

    @property
    def env_dir(self) -> Path:
        return self.run_dir / "env"

    @property
    def restore_runc_root(self) -> Path:
        """runc's state directory for containers of the ``restore_runtime``
        (``/run/docker/runtime-<name>/moby``, next to ``runc_root``)."""
        return (
            self.runc_root.parent.parent / f"runtime-{self.restore_runtime}" / self.runc_root.name
        )

    @property
    def run_key(self) -> str:
        """The ``belayer.run`` label of this run directory's sandboxes: stable across runs (a
        hash of the resolved run directory), so a restarted service — or the next ``up`` of the
        same run directory — recognises and reaps or adopts them."""
        digest = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()
        return "run-" + digest[:16]

    @property
    def keep_marker(self) -> Path:
        """Present while the sandboxes are kept for the next start (``belayer down
        --keep-sandboxes``): a stop then keeps them instead of destroying them."""
        return self.env_dir / "keep-sandboxes"

    @property
    def checkpoint_root(self) -> Path:
        return self.env_dir / "checkpoints"

    @property
    def records_dir(self) -> Path:
        return self.env_dir / "sandboxes"
