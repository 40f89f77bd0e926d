"""The router's data: the actions its core asks the service to execute, and the state it
keeps per engine and per request. Decisions live in ``core.py``."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

import msgspec

from common.errors import InvalidRequest, ResourceLimit
from schemas.base import Message
from schemas.events import AnyEvent
from schemas.serving import EngineInfo, EngineRequest, SamplingParams, TokenLogChunk
from services.router.config import RouterConfig


# --- actions the service executes -----------------------------------------------------------
@dataclass
class SendToCaller:
    inbox: str
    message: Message


@dataclass
class SubmitToEngine:
    engine_id: str
    epoch: int
    requests: list[EngineRequest]


@dataclass
class AbortOnEngine:
    engine_id: str
    epoch: int
    request_ids: list[str]


@dataclass
class PersistChunk:
    chunk: TokenLogChunk


@dataclass
class EmitEvent:
    event: AnyEvent
    """Published on ``belayer.events.<kind>`` (``common.events.publish``)."""


Action = SendToCaller | SubmitToEngine | AbortOnEngine | PersistChunk | EmitEvent


class EngineStatus(enum.Enum):
    UP = "up"
    """A worker of the current epoch is registered and serving."""
    DOWN = "down"
    """The worker failed; its requests wait for the next worker (shadow or restart)."""
    UNHEALTHY = "unhealthy"
    """Repeated failure: excluded; its requests were spread over healthy engines."""


@dataclass
class EngineState:
    id: str
    epoch: int
    worker_pid: int
    device: str = "cpu"
    max_num_seqs: int = 16
    weight_version: int = 0
    status: EngineStatus = EngineStatus.UP
    assigned: set[str] = field(default_factory=set)
    failures: list[float] = field(default_factory=list)
    down_reason: str = ""
    """Why the engine is down; only the router's own suspicion (``submit failed``) may be
    withdrawn when the worker answers after all."""

    @property
    def load(self) -> float:
        return len(self.assigned) / max(1, self.max_num_seqs)

    def info(self) -> EngineInfo:
        return EngineInfo(
            id=self.id,
            epoch=self.epoch,
            worker_pid=self.worker_pid,
            healthy=self.status is not EngineStatus.UNHEALTHY,
            device=self.device,
            running=len(self.assigned),
            weight_version=self.weight_version,
            failures=len(self.failures),
        )


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    pinned_engine: str | None = None
    subscribers: dict[str, bool] = field(default_factory=dict)
    """reply inbox → wants deltas."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    engine_id: str | None = None
    engine_history: list[str] = field(default_factory=list)
    resumes: int = 0
    logged: int = 0
    chunk_index: int = 0
    version_changed: bool = False
    regenerated: int = 0
    """Tokens a worker produced again that the router already held (dropped by index)."""
    router_restarts: int = 0
    """1 when a restarted router rebuilt this request from the durable log."""
    identity: str = ""
    """Digest of the request as the caller sent it (``request_identity``): a resubmission of
    the same id must match it."""


def request_identity(prompt_ids: list[int], sampling: SamplingParams) -> str:
    """Digest of what makes a request itself: the prompt's token ids and the sampling
    parameters as the caller sent them (before the router fills in a seed)."""
    return hashlib.sha256(msgspec.msgpack.encode([prompt_ids, sampling])).hexdigest()[:32]


def check_limits(config: RouterConfig, prompt_ids: list[int], sampling: SamplingParams) -> None:
    """The router's request limits (typed errors naming the field)."""
    if not prompt_ids:
        raise InvalidRequest("empty prompt", field="$.prompt")
    if len(prompt_ids) > config.max_prompt_tokens:
        raise ResourceLimit(
            "prompt too long",
            field="$.prompt",
            tokens=len(prompt_ids),
            limit=config.max_prompt_tokens,
        )
    if sampling.max_tokens > config.max_new_tokens:
        raise ResourceLimit(
            "max_tokens too large",
            field="$.sampling.max_tokens",
            limit=config.max_new_tokens,
        )
