"""Rollout worker configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common.device import DeviceChoice
from common.limits import ServingLimits
from common.service import ServiceConfig
from services.worker.engine.backend import EngineBackendName
from services.worker.engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerConfig(ServiceConfig):
    """Every field defaulted; loaded once in ``__main__``."""

    engine_id: str = "e0"
    """The engine this worker serves (one main + one shadow per engine)."""
    role: Literal["main", "shadow"] = "main"
    """``main`` claims the engine at start; ``shadow`` prepares, then waits to take over."""
    heartbeat_file: str = ""
    """File whose mtime the worker refreshes every scheduling-loop turn (empty: none)."""
    idle_turn_s: float = 0.05
    """Longest wait of an idle scheduling loop; bounds heartbeat staleness while idle (far
    below the hang threshold). New work wakes the loop at once."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Scheduler limits; ``num_blocks``/``block_size`` are taken from the KV arena."""
    device: DeviceChoice = "cpu"
    """Where the engine computes: ``cpu``; ``cuda`` (refused at start without a CUDA device;
    the ``belayer`` backend then needs ``--no-engine-deterministic``); ``auto`` (``cuda`` when
    torch sees one). The resolved device is what the worker reports to the router."""
    engine_backend: EngineBackendName = "belayer"
    """The engine behind the worker: ``belayer`` (Belayer's own, CPU or GPU) or ``sglang``
    (SGLang's offline engine, GPU nodes only; needs the ``sglang`` package and ``cuda``)."""
    register_timeout_s: float = 30.0
    """How long to keep trying to register with the router at start."""
    torch_threads: int = 1
    """torch intra-op threads (one per worker process on this 2-core machine)."""
    cold_load_dir: str = ""
    """Baseline mode: load weights from this model directory on disk instead of mapping the
    weight store's shared memory (what a cold engine restart does)."""
    watch_interval_s: float = 0.2
    """Shadow: how often it reads the main worker's heartbeat, which only matters for hangs
    (threshold ``hang_threshold_s``); death is seen at once through a pidfd."""
    hang_threshold_s: float = 2.0
    """Shadow: a heartbeat older than this (with the process alive) means the main worker hung.
    Longer than any single engine step, so a long prefill is never mistaken for a hang."""
    bus_check_timeout_s: float = 0.5
    """Shadow: how long the weight store and KV arena get to answer the handover health check."""
    owner_restart_wait_s: float = 30.0
    """How long a worker or shadow keeps asking a weight store or KV arena that the supervisor
    is restarting (no responder on its subject) — at start, in a handover's health check,
    when following a weight push — before it gives up (a shadow that gave up exits and is
    started again). A restarted service on two loaded cores can take over 10 s to import
    torch and serve."""
    host: str = ""
    """Engine-host mode: this worker runs on that engine host and maps its local weight
    store and KV arena (``belayer.host.<host>.*``); empty: the node's."""
    limits: ServingLimits = field(default_factory=ServingLimits)
    """Request limits and the queue bound (the supervisor forwards the router's): a submit
    beyond them is refused, whoever sent it."""
