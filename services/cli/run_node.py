"""The node under ``belayer run``: a running node found (and checked: it trains, on this
model), or one started for the run (``belayer up --training`` in ``<run dir>/node``) and
stopped at its end; the events the run follows; the kills the run injects itself (a trainer
during its update, a shadow during a rollout)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nats.js.api import DeliverPolicy

from common import subjects
from common.bus import connect
from common.codec import decode
from common.config import RunPaths
from common.errors import BelayerError, InvalidRequest, Timeout
from common.node import NodeInfo, read_node, resolve_bus
from common.training_config import OptimConfig
from schemas.events import AnyEvent, EventBase
from schemas.trainer import TrainerStatus
from services.cli.node import launch, pid_alive
from services.supervisor.client import supervisor_status
from services.supervisor.config import SupervisorConfig
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
    if node is None or not node.ready or not pid_alive(node.supervisor_pid):
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
    hold_before_checkpoint_s: float = 0.0,
) -> TrainerConfig:
    """The trainer of a node ``belayer run`` starts: ``group_size`` samples a group,
    ``groups_per_step`` groups a step, a checkpoint every step under ``checkpoint_dir``."""
    d = TrainerConfig()
    return dataclasses.replace(
        d,
        group_size=group_size,
        groups_per_step=groups_per_step,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        hold_before_checkpoint_s=hold_before_checkpoint_s,
        ack_wait_s=ACK_WAIT_S,
        optim=OptimConfig(lr=lr, seed=seed),
        grpo=GrpoConfig(micro_batch_size=MICRO_BATCH),
    )


def start_node(
    paths: RunPaths,
    *,
    model_dir: Path,
    environment: bool,
    trainer: TrainerConfig,
    recovery: str = "belayer",
    timeout: float = 240.0,
) -> NodeInfo:
    """A fresh node for the run (``belayer up --detach --training``, its JetStream store and
    all under ``paths``, so no stale trajectory is on its bus) with ``trainer``."""
    shutil.rmtree(paths.root, ignore_errors=True)
    d = SupervisorConfig()
    config = dataclasses.replace(
        d,
        run_dir=str(paths.root),
        model_dir=str(model_dir),
        environment=environment,
        training=True,
        ready_timeout_s=timeout,
        router=dataclasses.replace(
            d.router, recovery="baseline" if recovery == "baseline" else "belayer"
        ),
        worker=dataclasses.replace(d.worker, hang_threshold_s=HANG_THRESHOLD_S),
        trainer=trainer,
    )
    return launch(config, paths, timeout)


def stop_node(paths: RunPaths) -> None:
    """``belayer down`` of a node the run started (its lines go to stderr)."""
    from services.cli.node import down

    with contextlib.redirect_stdout(sys.stderr):
        down(run_dir=paths.root, timeout=60.0, keep=False)


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


class EventTail:
    """Every event published on the node from now on, in order; ``wait_for`` blocks until a
    matching one is there (bounded)."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.events: list[EventBase] = []
        self._changed = asyncio.Condition()
        self._sub: Any = None

    async def start(self) -> EventTail:
        async def cb(msg: Any) -> None:
            try:
                ev: EventBase = decode(msg.data, AnyEvent)
            except BelayerError:
                return  # not ours to trust, or a newer kind
            async with self._changed:
                self.events.append(ev)
                self._changed.notify_all()

        self._sub = await self.nc.jetstream().subscribe(
            subjects.EVENTS_ALL, ordered_consumer=True, cb=cb, deliver_policy=DeliverPolicy.NEW
        )
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    def of(self, typ: type[E], *, after: float = 0.0, **fields: object) -> list[E]:
        return [
            e
            for e in self.events
            if isinstance(e, typ)
            and e.ts >= after
            and all(getattr(e, k) == v for k, v in fields.items())
        ]

    async def wait_for(
        self, match: Callable[[EventBase], bool], timeout: float, what: str
    ) -> EventBase:
        """The first event ``match`` accepts (from the start of the tail)."""

        async def first() -> EventBase:
            async with self._changed:
                while True:
                    for e in self.events:
                        if match(e):
                            return e
                    await self._changed.wait()

        try:
            return await asyncio.wait_for(first(), timeout)
        except TimeoutError:
            raise Timeout(f"no {what} within {timeout:.0f} s", timeout=timeout) from None


def node_config_of(node: NodeInfo) -> dict[str, Any]:
    """What the run reports about its node."""
    return {"run_id": node.run_id, "recovery": node.recovery, "engines": list(node.engines),
            "model_dir": node.model_dir, "nats_url": node.nats_url}  # fmt: skip


__all__ = [
    "EventTail",
    "NodeHandle",
    "kill_process",
    "node_config_of",
    "open_bus",
    "run_trainer_config",
    "running_node",
    "start_node",
    "stop_node",
    "supervisor_procs",
    "wait_trainer",
]
