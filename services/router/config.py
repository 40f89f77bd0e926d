"""Router configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common.limits import ServingLimits
from common.service import ServiceConfig


@dataclass(frozen=True)
class RouterConfig(ServiceConfig):
    """Every field defaulted; loaded once in ``__main__`` and passed down."""

    model_dir: str = ""
    """Model directory whose tokenizer the router uses for text prompts and results."""
    token_log_chunk: int = 256
    """k: tokens per durable token-log chunk (JetStream stream TOKENS)."""
    limits: ServingLimits = field(default_factory=ServingLimits)
    """Request limits and each engine's queue bound; the supervisor forwards these to every
    worker, which enforces them too."""
    engine_ids: tuple[str, ...] = ("e0",)
    """The node's engines (the supervisor fills them in): a registration for any other id is
    refused ``not_found``."""
    failure_window_s: float = 60.0
    """A second failure of the same engine inside this window marks its device unhealthy."""
    recovery: Literal["belayer", "baseline"] = "belayer"
    """``baseline`` regenerates interrupted requests from scratch (for comparison)."""
    finished_cache: int = 10_000
    """Finished results kept in memory for replay to a resubmitted request id."""
    max_requests: int = 16_384
    """Unfinished requests the router holds at once (running, queued, waiting for an engine);
    a new one beyond them is refused ``overloaded`` (retryable), so a flood of requests cannot
    exhaust the router's memory."""
    submit_timeout_s: float = 2.0
    """How long a worker may take to acknowledge a submit before the engine counts as failed."""
    heartbeat_interval_s: float = 5.0
    """Remote heartbeat: how often the router pings every engine (the baseline's detector; a
    fallback in belayer mode, where shadows detect failures in milliseconds)."""
    heartbeat_timeout_s: float = 1.0
    """A ping unanswered this long counts as a failure."""
    restore_timeout_s: float = 30.0
    """Longest time a restarted router spends reading the token log back."""
