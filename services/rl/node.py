"""The node under a run: a running node found (and checked: it trains, on this model), or one
started for the run (``belayer up --training`` in ``<run dir>/node``) and stopped at its end;
the events the run follows; the kills the run injects itself (a trainer during its update, a
shadow during a rollout). Starting and stopping a node are plain functions here (``launch``,
``shut_down``); ``belayer up`` and ``belayer down`` print what they return."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from common.auth import redact
from common.bus import connect
from common.config import RunPaths, config_argv
from common.errors import BelayerError, BusUnavailable, FatalError, InvalidRequest, Timeout
from common.heartbeat import process_alive
from common.node import NodeInfo, read_node, resolve_bus
from common.training_config import OptimConfig
from schemas.events import EventBase
from schemas.trainer import TrainerStatus
from services.environment.client import (
    SandboxCleanup,
    keep_sandboxes,
    node_label,
    remove_node_sandboxes,
)
from services.supervisor.client import SupervisorConfig, remove_shm_files, supervisor_status
from services.supervisor.client import stop_node as ask_supervisor_to_stop
from services.trainer.client import GrpoConfig, TrainerConfig, trainer_status

E = TypeVar("E", bound=EventBase)
MICRO_BATCH = 2
"""Sequences per forward/backward of the run's trainer: a 2048-token SWE trajectory's
activations are large on CPU (8 of them at once peak near 8 GB)."""
HANG_THRESHOLD_S = 10.0
"""A main worker whose heartbeat is older than this counts as hung (the node default, 2 s,
takes a busy 2-core machine's stalls for hangs; a killed worker is seen at once anyway)."""
ACK_WAIT_S = 6.0
"""The run's trainer: JetStream redelivers a killed trainer's unacked trajectories this soon
(the live trainer marks them in progress every third of it)."""


@dataclass
class NodeHandle:
    """The node a run uses."""

    paths: RunPaths
    info: NodeInfo
    ours: bool
    """Started by this run (stopped at its end unless ``--keep-node``)."""


def running_node(paths: RunPaths) -> NodeInfo | None:
    """The node running from ``paths`` (its supervisor alive), if any."""
    node = read_node(paths)
    if node is None or not node.ready or not process_alive(node.supervisor_pid):
        return None
    return node


def run_trainer_config(
    *,
    group_size: int,
    groups_per_step: int,
    checkpoint_dir: Path,
    resume: bool = False,
    seed: int = 0,
    lr: float = 1e-4,
    decay_steps: int = 0,
    hold_before_checkpoint_s: float = 0.0,
    procs: int = TrainerConfig.procs,
    objective: GrpoConfig | None = None,
) -> TrainerConfig:
    """The trainer of a node ``belayer run`` starts: ``group_size`` samples a group,
    ``groups_per_step`` groups a step, a checkpoint every step under ``checkpoint_dir``,
    ``procs`` data-parallel ranks; the learning rate falls from ``lr`` to 0 along a cosine over
    ``decay_steps`` steps (0: constant); ``objective``'s loss, KL coefficient and optimiser
    steps a batch (default ``GrpoConfig()``'s), micro-batches of ``MICRO_BATCH``."""
    d = TrainerConfig()
    grpo = dataclasses.replace(objective or GrpoConfig(), micro_batch_size=MICRO_BATCH)
    return dataclasses.replace(
        d,
        group_size=group_size,
        groups_per_step=groups_per_step,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        hold_before_checkpoint_s=hold_before_checkpoint_s,
        procs=procs,
        ack_wait_s=ACK_WAIT_S,
        optim=OptimConfig(lr=lr, seed=seed, decay_steps=decay_steps * grpo.minibatches),
        grpo=grpo,
    )


def start_node(
    paths: RunPaths,
    *,
    model_dir: Path,
    environment: bool,
    trainer: TrainerConfig,
    recovery: str = "belayer",
    timeout: float = 240.0,
    workload_plugins: tuple[str, ...] = (),
    reward_functions: tuple[str, ...] = (),
    owner_pid: int = 0,
    first_version: int = 1,
) -> NodeInfo:
    """A fresh node for the run (``belayer up --detach --training``, its JetStream store and
    all under ``paths``, so no stale trajectory is on its bus) with ``trainer``; its
    controller may load ``workload_plugins`` and ``reward_functions`` (``belayer up
    --workload-plugin``/``--reward-function``). With ``owner_pid`` the node stops itself
    when that process exits (``SupervisorConfig.owner_pid``); its weight store loads the
    model as ``first_version`` (``WeightStoreConfig.first_version``). A node still running
    from ``paths`` must be stopped first (:func:`stop_node`): its directory is started
    afresh."""
    shutil.rmtree(paths.root, ignore_errors=True)
    d = SupervisorConfig()
    config = dataclasses.replace(
        d,
        run_dir=str(paths.root),
        model_dir=str(model_dir),
        environment=environment,
        training=True,
        ready_timeout_s=timeout,
        owner_pid=owner_pid,
        weights=dataclasses.replace(d.weights, first_version=first_version),
        router=dataclasses.replace(
            d.router, recovery="baseline" if recovery == "baseline" else "belayer"
        ),
        worker=dataclasses.replace(d.worker, hang_threshold_s=HANG_THRESHOLD_S),
        trainer=trainer,
        controller=dataclasses.replace(
            d.controller, workload_plugins=workload_plugins, reward_functions=reward_functions
        ),
    )
    return launch(config, paths, timeout)


class NodeFailed(FatalError):
    """The node did not start, or its sandboxes could not be removed (the message is the
    command's ``error:`` line, as it stands)."""

    code = "node_failed"


def docker_usable(timeout: float = 3.0) -> bool:
    """Whether dockerd answers on its socket (then ``up`` runs the environment service)."""
    try:
        import docker

        client = docker.DockerClient(version="auto", timeout=int(max(1, timeout)))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no SDK, no socket, no daemon: no sandboxes
        return False


def launch(config: SupervisorConfig, paths: RunPaths, timeout: float) -> NodeInfo:
    """Start the supervisor of ``config`` in its own session (``belayer up --detach``) and
    wait until its node file says ready; a start that fails or times out raises
    ``NodeFailed`` (``belayer run`` and the benchmarks start their nodes with this too)."""
    argv = [sys.executable, "-m", "services.supervisor", *config_argv(config)]
    paths.logs.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        paths.node_file.unlink()
    t0 = time.monotonic()
    out_log = paths.logs / "supervisor.out"
    offset = out_log.stat().st_size if out_log.exists() else 0
    with open(out_log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
    while True:
        node = read_node(paths)
        if node is not None and node.ready and node.supervisor_pid == proc.pid:
            return node
        if proc.poll() is not None:
            with open(out_log, "rb") as f:
                f.seek(offset)
                tail = redact(f.read().decode(errors="replace")[-3000:])
            reason = [ln for ln in tail.splitlines() if ln.startswith("error: ")]
            if reason:  # the supervisor's own one-line reason
                raise NodeFailed(f"the node failed to start: {reason[-1].removeprefix('error: ')}")
            raise NodeFailed(f"the node failed to start (exit {proc.returncode}):\n{tail}")
        if time.monotonic() - t0 > timeout:
            proc.terminate()
            raise NodeFailed(f"the node was not ready after {timeout:.0f} s; logs in {paths.logs}")
        time.sleep(0.05)  # polling the node file the supervisor writes when ready


@dataclass
class Stopped:
    """What ``shut_down`` stopped and removed."""

    run_id: str
    shm_files: int
    """Leftover shared-memory files removed."""
    cleanup: SandboxCleanup
    root: Path
    """The node's run directory."""

    def lines(self) -> list[str]:
        """What ``belayer down`` prints."""
        c = self.cleanup
        sandboxes = (
            f", {c.containers} sandbox containers and {c.checkpoint_dirs} sandbox checkpoint dirs"
            if c.containers or c.checkpoint_dirs
            else ""
        )
        out = [
            f"belayer node stopped (run {self.run_id}; {self.shm_files} leftover shm files"
            f"{sandboxes} removed)"
        ]
        if c.kept:
            out.append(f"{c.kept} sandboxes kept for the next `belayer up` of {self.root}")
        return out


def shut_down(paths: RunPaths, *, timeout: float = 30.0, keep: bool = False) -> Stopped | None:
    """Stop the node of ``paths``: every service (the supervisor drains them; a signal when
    the bus is gone, SIGKILL after ``timeout``), a NATS server it left, its shared-memory
    files, its sandbox containers and their checkpoints (unless ``keep``). None when no node
    is there; ``NodeFailed`` when its sandboxes could not be removed. Idempotent."""
    node = read_node(paths)
    if node is None:
        return None
    keep_sandboxes(paths.root, keep)
    pid = node.supervisor_pid
    if process_alive(pid):
        try:
            if node.role != "node":  # a joined host: supervisor.stop is the deployment node's
                raise BusUnavailable("stopped by signal")
            asyncio.run(_ask_stop(node, paths))
        except Exception:  # fall back to a signal if the bus is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the supervisor process to exit
        if process_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    # A supervisor that died without its shutdown leaves the NATS server it started (its own
    # session's other processes die with it: PR_SET_PDEATHSIG).
    if node.nats_pid is not None and is_nats_server(node.nats_pid):
        stop_process(node.nats_pid, timeout=5.0)
    removed = remove_shm_files(node.run_id)
    # Sandboxes do not outlive their node; a killed environment service left them behind.
    cleanup = remove_node_sandboxes(node_label(node.run_id), paths.root)
    if cleanup.error:
        raise NodeFailed(
            f"could not remove the node's sandbox containers ({cleanup.error}); "
            "run `belayer down` again once dockerd answers"
        )
    with contextlib.suppress(FileNotFoundError):
        paths.node_file.unlink()
    return Stopped(node.run_id, removed, cleanup, paths.root)


async def _ask_stop(node: NodeInfo, paths: RunPaths) -> None:
    """``supervisor.stop`` over the bus, as the node's operator (no reconnect loops)."""
    url, bus = resolve_bus(node.nats_url, role="operator", paths=paths)
    nc = await connect(url, name="cli", bus=bus, timeout=3.0, reconnect=False)
    try:
        await ask_supervisor_to_stop(nc, "belayer down", timeout=3)
    finally:
        await nc.drain()


def stop_process(pid: int, timeout: float) -> None:
    """SIGTERM ``pid``, then SIGKILL if it still runs after ``timeout`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for the process to exit
    if process_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def is_nats_server(pid: int) -> bool:
    """``pid`` is alive and runs nats-server (not some process that reused the pid)."""
    if not process_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"nats-server" in f.read()
    except OSError:
        return False


def stop_node(paths: RunPaths) -> None:
    """``belayer down`` of a node the run started (its lines go to stderr)."""
    stopped = shut_down(paths, timeout=60.0, keep=False)
    for line in stopped.lines() if stopped else ["no node is running here"]:
        print(line, file=sys.stderr)


async def open_bus(node: NodeHandle) -> Any:
    """A connection as the node's operator (events, sandboxes, status), reconnecting."""
    url, bus = resolve_bus(None, role="operator", paths=node.paths)
    return await connect(url, name="cli-run", bus=bus, timeout=5.0)


async def supervisor_procs(nc: Any) -> dict[str, tuple[int, bool]]:
    """Process name → (pid, alive), from the supervisor."""
    st = await supervisor_status(nc, timeout=5)
    return {p.name: (p.pid or 0, p.alive) for p in st.procs}


async def wait_trainer(nc: Any, timeout: float = 120.0) -> TrainerStatus:
    """The trainer's status once it answers and has no step left to redo."""
    deadline = time.monotonic() + timeout
    last: BelayerError | None = None
    while time.monotonic() < deadline:
        try:
            st = await trainer_status(nc, timeout=2.0)
            if st.replaying == 0 and not st.busy:
                return st
        except BelayerError as exc:
            last = exc
        await asyncio.sleep(0.2)  # the trainer is starting or redoing a step: bounded poll
    if last is not None:
        raise InvalidRequest(
            "the node runs no trainer: stop it (`belayer down`) or start it with "
            "`belayer up --training`"
        )
    raise Timeout("the trainer did not become idle", timeout=timeout)


def kill_process(pid: int, expect: str) -> bool:
    """SIGKILL ``pid`` if it is a live process whose command line holds ``expect``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if expect.encode() not in f.read():
                return False
        os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        return False
    return True


def node_config_of(node: NodeInfo) -> dict[str, Any]:
    """What the run reports about its node."""
    return {"run_id": node.run_id, "recovery": node.recovery, "engines": list(node.engines),
            "model_dir": node.model_dir, "nats_url": node.nats_url}  # fmt: skip


__all__ = [
    "NodeFailed",
    "NodeHandle",
    "Stopped",
    "is_nats_server",
    "kill_process",
    "launch",
    "node_config_of",
    "open_bus",
    "run_trainer_config",
    "running_node",
    "shut_down",
    "start_node",
    "stop_node",
    "stop_process",
    "supervisor_procs",
    "wait_trainer",
]
