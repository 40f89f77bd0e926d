"""The router's data: the actions its core asks the service to execute, and the state it
keeps per engine and per request. Decisions live in ``core.py``."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

import msgspec

from common.errors import InvalidRequest
from common.limits import check_request
from schemas.base import Message
from schemas.events import AnyEvent
from schemas.serving import (
    EngineInfo,
    EngineRequest,
    GenerateResult,
    SamplingParams,
    TokenDelta,
    TokenLogChunk,
)
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
    """Why the engine is down; only the router's own suspicion (``submit failed``; in belayer
    mode a missed ``heartbeat`` too) may be withdrawn when the worker answers after all."""
    max_queued: int = 64
    """Requests the worker holds beyond its running batch (``ServingLimits.max_queued``)."""
    reported: int = 0
    """Requests the worker itself last said it holds (running + queued, whoever sent them)."""
    sent_since_report: int = 0
    """Requests submitted to it since that report (not counted in it yet)."""

    @property
    def capacity(self) -> int:
        """Most requests the worker takes at once (more are refused ``engine_unavailable``)."""
        return self.max_num_seqs + self.max_queued

    @property
    def holding(self) -> int:
        """Requests the worker holds as far as the router can tell: its own count plus what
        was sent since, and never fewer than the router assigned to it."""
        return max(len(self.assigned), self.reported + self.sent_since_report)

    @property
    def load(self) -> float:
        return self.holding / max(1, self.max_num_seqs)

    @property
    def has_room(self) -> bool:
        return self.holding < self.capacity

    def report(self, running: int, waiting: int) -> None:
        """The worker's own counts (from a step batch or a ping reply)."""
        self.reported = running + waiting
        self.sent_since_report = 0

    def info(self) -> EngineInfo:
        return EngineInfo(
            id=self.id,
            epoch=self.epoch,
            worker_pid=self.worker_pid,
            healthy=self.status is EngineStatus.UP,
            device=self.device,
            running=len(self.assigned),
            weight_version=self.weight_version,
            failures=len(self.failures),
            state=self.status.value,
            holding=self.holding,
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
    watch_mark: tuple[str, int, int] | None = None
    """(engine, epoch, tokens held) at the previous stall check (``RouterCore.stalled``)."""
    identity: str = ""
    """Digest of the request as the caller sent it (``request_identity``): a resubmission of
    the same id must match it."""

    def replay(self, chunks: list[TokenLogChunk]) -> str | None:
        """Take the tokens of the durable log back (the contiguous prefix of ``chunks``); the
        finish reason if the log says the request finished, else None."""
        for c in sorted(chunks, key=lambda c: c.chunk_index):
            if c.start != len(self.tokens):
                break  # a gap: keep the contiguous prefix only
            self.tokens += c.token_ids
            self.logprobs += c.logprobs
            self.versions += c.weight_versions
            self.chunk_index = c.chunk_index + 1
            self.logged = len(self.tokens)
            if c.final:
                return c.finish_reason or "stop"
        return None

    def hold(self, toks: list[int], lps: list[float], version: int) -> None:
        """Append new tokens, their log-probabilities and the weight version they came from."""
        if self.versions and self.versions[-1] != version:
            self.version_changed = True
        self.tokens += toks
        self.logprobs += lps
        self.versions += [version] * len(toks)

    def room(self, k: int) -> int:
        """Tokens until the next k-token log chunk is full (at least 1)."""
        return max(1, self.logged + k - len(self.tokens))

    def engine_request(self, *, baseline: bool) -> EngineRequest:
        """The request as a worker gets it: prompt + every token held (token-level resume),
        or — ``baseline`` — the prompt alone: the caller already has the held tokens, so the
        first ones the worker produces again are dropped by index (counted as regenerated).
        Exact for greedy; with sampling the regenerated tokens can differ."""
        held = len(self.tokens)
        if baseline and held:
            return EngineRequest(
                request_id=self.request_id,
                token_ids=list(self.prompt_ids),
                generated_offset=0,
                sampling=self.sampling,
            )
        s = self.sampling
        sampling = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            max_tokens=max(1, s.max_tokens - held),
            stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos,
        )
        return EngineRequest(
            request_id=self.request_id,
            token_ids=self.prompt_ids + self.tokens,
            generated_offset=held,
            sampling=sampling,
            held_logprobs=list(self.logprobs),
        )

    def result(self, reason: str, text: str, router_id: str) -> GenerateResult:
        """The finished request as its callers get it (``text``: the tokens decoded)."""
        return GenerateResult(
            request_id=self.request_id,
            token_ids=self.tokens,
            text=text,
            logprobs=self.logprobs,
            weight_version=self.versions[-1] if self.versions else 0,
            finish_reason=reason,  # type: ignore[arg-type]  # callers pass FinishReason values
            prompt_token_ids=self.prompt_ids,
            token_weight_versions=self.versions,
            engine_ids=self.engine_history,
            resumes=self.resumes,
            version_changed=self.version_changed,
            regenerated=self.regenerated,
            router_id=router_id,
            router_restarts=self.router_restarts,
        )

    def delta(self, start: int, end: int, router_id: str) -> TokenDelta:
        """Tokens ``[start, end)`` as a caller gets them."""
        return TokenDelta(
            request_id=self.request_id,
            start=start,
            token_ids=self.tokens[start:end],
            logprobs=self.logprobs[start:end],
            weight_version=self.versions[end - 1] if end else 0,
            router_id=router_id,
        )

    def chunk(self, end: int, *, final: bool, reason: str | None) -> TokenLogChunk:
        """The next token-log chunk: the tokens from the last logged one up to ``end``."""
        chunk = TokenLogChunk(
            request_id=self.request_id,
            chunk_index=self.chunk_index,
            start=self.logged,
            token_ids=self.tokens[self.logged : end],
            logprobs=self.logprobs[self.logged : end],
            weight_versions=self.versions[self.logged : end],
            final=final,
            finish_reason=reason,  # type: ignore[arg-type]  # callers pass FinishReason values
        )
        self.chunk_index += 1
        self.logged = end
        return chunk


def request_identity(prompt_ids: list[int], sampling: SamplingParams) -> str:
    """Digest of what makes a request itself: the prompt's token ids and the sampling
    parameters as the caller sent them (before the router fills in a seed)."""
    return hashlib.sha256(msgspec.msgpack.encode([prompt_ids, sampling])).hexdigest()[:32]


def check_limits(config: RouterConfig, prompt_ids: list[int], sampling: SamplingParams) -> None:
    """The router's request limits (typed errors naming the field); the workers apply the same
    ``ServingLimits`` to what reaches them."""
    if not prompt_ids:
        raise InvalidRequest("empty prompt", field="$.prompt")
    check_request(config.limits, prompt_tokens=len(prompt_ids), max_tokens=sampling.max_tokens)
