"""Node supervisor configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SupervisorConfig:
    """Every field defaulted; ``belayer up`` fills it from its flags."""

    run_dir: str = ".belayer"
    """Run directory: node file, logs, NATS store, heartbeats."""
    nats_url: str = ""
    """Use this NATS server; empty: start a local nats-server with JetStream."""
    model_dir: str = ""
    """Hugging Face style model directory (empty: a tiny random model under the run dir)."""
    engines: int = 1
    """Rollout engines on this node (one main worker each, plus a shadow in belayer mode)."""
    recovery: Literal["belayer", "baseline"] = "belayer"
    """belayer: shadow workers + token-level resume; baseline: cold restart + regenerate."""
    token_log_chunk: int = 256
    """k for the router's token log."""
    max_num_seqs: int = 16
    """Decode batch limit per engine."""
    num_blocks: int = 512
    """KV blocks per engine arena."""
    block_size: int = 16
    """Tokens per KV block."""
    environment: bool = False
    """Also run the environment (sandbox) service; needs dockerd + CRIU (deploy/setup.sh)."""
    restart_backoff_s: float = 0.5
    """First restart delay of a crashed service; doubles up to ``restart_backoff_max_s``."""
    restart_backoff_max_s: float = 10.0
    """Largest restart delay."""
    stable_after_s: float = 30.0
    """A service that ran this long has its backoff reset."""
    ready_timeout_s: float = 120.0
    """How long start-up may take before ``up`` fails."""
    handover_timeout_s: float = 15.0
    """How long a dead main worker waits for its shadow's handover before a cold restart."""
    hang_threshold_s: float = 2.0
    """Shadow: heartbeat age (process alive) that counts as a hang."""
    heartbeat_interval_s: float = 5.0
    """Router's remote heartbeat interval (the baseline detector)."""
    failure_window_s: float = 60.0
    """A second failure of an engine inside this window marks it unhealthy."""
    run_id: str = ""
    """Names this node's shared-memory files (empty: generated)."""
