"""Node supervisor configuration: the node's own settings, and the config of every service it
starts (forwarded to the child with ``common.config.config_argv``, so each knob is declared
once, in its service's config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.auth import BusConfig
from common.config import RunPaths
from common.subjects import check_token
from services.controller.client import ControllerConfig
from services.environment.client import EnvConfig
from services.kv.client import KvArenaConfig
from services.router.client import RouterConfig
from services.trainer.client import TrainerConfig
from services.weights.client import WeightStoreConfig
from services.worker.client import WorkerConfig


@dataclass(frozen=True)
class SupervisorConfig:
    """Every field defaulted; ``belayer up`` fills it from its flags. In the nested service
    configs the supervisor fills in what only the node knows: the bus URL, the run id, the model
    directory, the engine ids (KV arena and router), heartbeat and log files, the environment's
    node label, and the router's limits for every worker."""

    run_dir: str = ".belayer"
    """Run directory: node file, logs, NATS store, heartbeats."""
    nats_url: str = ""
    """Use this NATS server (or cluster: comma-separated URLs); empty: start a local
    nats-server with JetStream, authentication on."""
    bus: BusConfig = field(default_factory=BusConfig)
    """The node's bus: TLS files (this host's certificate and key, the CA of its peers) and
    the JetStream replica count, forwarded to every service; a local nats-server serves TLS
    with the same files. Its ``creds`` is unused: identities come from ``creds_dir``."""
    creds_dir: str = ""
    """Identity files (``<name>.nk``) of this node's services on an existing deployment
    (``belayer auth init``); empty: a local nats-server gets identities generated under
    ``<run dir>/auth``, an existing server none (unauthenticated)."""
    metrics_port: int = -1
    """Serve the node's Prometheus metrics on this port (``/metrics``; 0: any free port, the
    one taken is in ``node.json`` as ``metrics_url``); -1: off."""
    metrics_addr: str = "127.0.0.1"
    """The address the metrics endpoint listens on."""
    owner_pid: int = 0
    """The process this node is for (``belayer run``'s own node, a foreground ``belayer up``):
    when it exits — also by SIGKILL, which it cannot clean up after — the supervisor stops the
    node as ``belayer down`` would. 0: none (``belayer up --detach``'s node runs until
    ``belayer down``)."""
    role: Literal["node", "env-host", "engine-host"] = "node"
    """``node``: every service; ``env-host``: only the environment service, on a host that
    joins an existing deployment (``nats_url``), whose controller it serves; ``engine-host``:
    rollout engines (workers and shadows) on a host that joins a deployment, with this host's
    own weight store (mirroring the node's versions) and KV arena."""
    host_name: str = ""
    """``engine-host``: this host's name; its engines are ``<host_name>-e0`` … and must be
    declared by the node (``engine_hosts``)."""
    engine_hosts: tuple[str, ...] = ()
    """``node``: engine hosts that may join it, each ``NAME:N`` (N engines, ``NAME-e0`` …):
    its router routes to their engines too; a local nats-server gets their identities under
    ``<run dir>/auth/<NAME>``."""
    model_dir: str = ""
    """Hugging Face style model directory (empty: a tiny random model under the run dir)."""
    engines: int = 1
    """Rollout engines on this node (one main worker each, plus a shadow in belayer mode)."""
    environment: bool = False
    """Also run the environment (sandbox) service; needs dockerd + CRIU (deploy/setup.sh)."""
    training: bool = False
    """Also run the GRPO trainer (``trainer``), started once the engines serve."""
    restart_backoff_s: float = 0.5
    """First restart delay of a crashed service; doubles up to ``restart_backoff_max_s``."""
    restart_backoff_max_s: float = 10.0
    """Largest restart delay."""
    stable_after_s: float = 30.0
    """A service that ran this long has its backoff reset."""
    ready_timeout_s: float = 120.0
    """How long start-up may take before ``up`` fails."""
    handover_timeout_s: float = 15.0
    """Deadline of a shadow's handover: not confirmed this long after it began (the main
    worker exited, or the shadow found it hung), the main worker is restarted cold (also at
    once when the shadow dies during the takeover)."""
    run_id: str = ""
    """Names this node's shared-memory files (empty: generated)."""
    weights: WeightStoreConfig = field(default_factory=WeightStoreConfig)
    """The weight store."""
    kv: KvArenaConfig = field(default_factory=KvArenaConfig)
    """The KV arena (one per engine)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The router; its ``recovery`` is the node's recovery mode, its ``limits`` (request
    limits, each engine's queue bound) are the node's: every worker gets them too."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """Every rollout worker and shadow of the node (``limits``: the router's are used)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment service (with ``environment`` on)."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The controller (agentic rollouts), started on every node after the engines; it gets
    the node's model directory (its tokenizer) and prompt limit."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The GRPO trainer (with ``training`` on); its checkpoints go under ``<run dir>/trainer``
    unless ``checkpoint_dir`` is set, and it trains deterministically when the workers do."""

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.role != "node" and not self.nats_url:
            raise ValueError(f"role {self.role} joins an existing deployment: give nats_url")
        if self.role == "engine-host":
            check_token(self.host_name, "host name")
            if self.router.recovery != "belayer":
                raise ValueError("an engine host runs belayer recovery (its shadows map its store)")
        for spec in self.engine_hosts:
            parse_engine_host(spec)
        if self.worker.limits not in (self.router.limits, WorkerConfig().limits):
            raise ValueError(
                "the node's limits are set once, on the router (--router-limits-…); "
                "the supervisor forwards them to every worker"
            )

    @property
    def remote_engine_ids(self) -> list[str]:
        """The engines of every declared engine host (``engine_hosts``)."""
        return [e for spec in self.engine_hosts for e in host_engine_ids(*parse_engine_host(spec))]

    @property
    def recovery(self) -> Literal["belayer", "baseline"]:
        """belayer: shadow workers + token-level resume; baseline: cold restart + regenerate."""
        return self.router.recovery

    @property
    def log_file(self) -> Path:
        """The supervisor's own JSON log."""
        return RunPaths(Path(self.run_dir).resolve()).logs / "supervisor.jsonl"


def host_engine_ids(host: str, engines: int) -> list[str]:
    """The engine ids of engine host ``host``: ``<host>-e0`` …"""
    return [f"{check_token(host, 'host name')}-e{i}" for i in range(engines)]


def parse_engine_host(spec: str) -> tuple[str, int]:
    """``NAME:N`` → (name, N); ``ValueError`` with one clear line otherwise."""
    name, _, count = spec.partition(":")
    check_token(name, "engine host name")
    if name == "node":
        raise ValueError("'node' is the node's own name: name the engine host otherwise")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ValueError(f"engine host {spec!r}: expected NAME:N (N engines)") from None
    if n < 1:
        raise ValueError(f"engine host {spec!r}: at least one engine")
    return name, n
