"""Messages of the serving path: callers ↔ router ↔ rollout workers, and the token log."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas.base import ErrorReply, Id, IdOrEmpty, Message

RequestId = Id
"""Caller-chosen request id: 1 to 128 letters, digits, ``_`` and ``-`` (``schemas.base.Id``)."""

EngineId = Id
"""Engine id (``e0``, …): a subject token (``belayer.engine.<engine_id>.generate``)."""

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id any message carries (vocabularies are far smaller; the router and the
worker check the model's own vocabulary)."""

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]

MAX_TOKENS = 1_000_000
"""Schema cap of ``SamplingParams.max_tokens`` (the router's own limit is lower, see
``RouterConfig``)."""

Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""A sampling seed: any signed 64-bit integer."""
FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to sample. ``temperature == 0`` is greedy."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    """Softmax temperature; 0 selects the argmax."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass."""
    seed: Seed | None = None
    """With a seed, token j of a request depends only on (seed, j, logits): resumes reproduce."""
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] = 64
    """Most new tokens to generate."""
    stop_token_ids: list[TokenId] = []
    """Extra ids that end the request (the model's EOS ids always do unless ``ignore_eos``)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""


class GenerateRequest(Message, tag="GenerateRequest.v1"):
    """Caller → router (``belayer.router.generate``). Replies stream to the message's reply inbox:
    ``TokenDelta`` messages (if ``stream``), then one ``GenerateResult`` or ``ErrorReply``."""

    request_id: RequestId
    """Caller-chosen id; resubmitting it never generates twice (the result is replayed)."""
    prompt: str | None = None
    """Prompt text (tokenized by the router). Exactly one of prompt / prompt_token_ids."""
    prompt_token_ids: list[TokenId] | None = None
    """Prompt as token ids."""
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    """Sampling parameters."""
    stream: bool = True
    """Send a ``TokenDelta`` per engine step before the final result."""
    engine_id: EngineId | None = None
    """Pin to one engine (unknown → ``not_found``); default: least-loaded healthy engine."""


class TokenDelta(Message, tag="TokenDelta.v1"):
    """Router → caller: new tokens of one request. ``start`` is the index of the first one."""

    request_id: RequestId
    start: int
    """Index (among generated tokens) of ``token_ids[0]``; lets callers detect gaps."""
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    """Weight version that produced these tokens."""
    router_id: IdOrEmpty = ""
    """Incarnation of the router process that sent this (new after every router restart), so
    a caller can tell it rode through a restart."""


class GenerateResult(Message, tag="GenerateResult.v1"):
    """Router → caller: the finished request."""

    request_id: RequestId
    token_ids: list[int]
    """Generated tokens (not the prompt)."""
    text: str
    """The text the model meant by ``token_ids``: decoded with special tokens dropped (no
    ``<|im_end|>``); what is scored, parsed for an action and shown. ``token_ids`` keep every
    id, the end-of-sequence one included."""
    logprobs: list[float]
    """Log-probability of each generated token under the sampling distribution."""
    weight_version: int
    """Weight version of the generated tokens (the version of the last one if it changed)."""
    finish_reason: FinishReason
    prompt_token_ids: list[int] = []
    token_weight_versions: list[int] = []
    """Weight version per generated token."""
    engine_ids: list[EngineId] = []
    """Engines that worked on the request, in order (more than one after a handover)."""
    resumes: int = 0
    """How many times the request was resumed on another worker."""
    version_changed: bool = False
    """True if the weight version changed between the prefix and a resumed continuation."""
    regenerated: int = 0
    """Tokens that were generated again after a failure (0 under token-level recovery)."""
    router_id: IdOrEmpty = ""
    """Incarnation of the router process that sent this result (see ``TokenDelta``)."""
    router_restarts: int = 0
    """Router restarts the request rode through: the router sends 1 when a restarted router
    rebuilt the unfinished request from its durable log; the Python client raises it to the
    number of router incarnations and outages it saw itself."""


GenerateReply = TokenDelta | GenerateResult | ErrorReply
"""Anything the router sends to a caller's reply inbox."""


class CancelRequest(Message, tag="CancelRequest.v1"):
    """Caller → router: abort a request."""

    request_id: RequestId


# --- router ↔ worker -----------------------------------------------------------------------
class EngineRequest(msgspec.Struct, kw_only=True):
    """One request as the router hands it to a worker (fresh or resumed)."""

    request_id: RequestId
    token_ids: list[TokenId]
    """Prompt + every token the router already holds (a resume rebuilds KV by prefill)."""
    generated_offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    """How many of ``token_ids`` were generated before (0 for a fresh request)."""
    sampling: SamplingParams
    """``max_tokens`` is what is left to generate."""
    held_logprobs: list[float] = []
    """Logprobs of the ``generated_offset`` held tokens, so the worker can report them back
    (``EngineStateReply``) to a restarted router."""


class EngineSubmit(Message, tag="EngineSubmit.v1"):
    """Router → worker (``belayer.engine.<id>.generate``); the worker replies ``Ok`` once queued."""

    engine_id: EngineId
    epoch: int
    """The engine epoch the router believes current; a worker of another epoch refuses."""
    requests: list[EngineRequest]


class EngineAbort(Message, tag="EngineAbort.v1"):
    """Router → worker: drop requests."""

    engine_id: EngineId
    epoch: int
    request_ids: list[RequestId]


class SeqDelta(msgspec.Struct, kw_only=True):
    """One request's output in one engine step."""

    request_id: RequestId
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    start: int = -1
    """Index of ``token_ids[0]`` among the request's generated tokens (held ones included);
    lets the router drop overlaps and detect gaps. -1: unknown."""


class StepBatch(Message, tag="StepBatch.v1"):
    """Worker → router (``belayer.router.tokens``): every request's new tokens of one step."""

    engine_id: EngineId
    epoch: int
    """Epoch of the worker that produced it; the router drops batches of stale epochs."""
    worker_pid: int
    step: int
    """Monotonic per worker."""
    weight_version: int
    deltas: list[SeqDelta]
    running: int = -1
    """Requests the worker runs after this step (whoever sent them); -1: not reported."""
    waiting: int = -1
    """Requests queued in the worker, not running yet; the router places new work by these
    counts. -1: not reported."""


class RegisterWorker(Message, tag="RegisterWorker.v1"):
    """Worker → router (``belayer.router.register``) when it becomes the engine's main worker."""

    engine_id: EngineId
    epoch: int
    pid: int
    device: str = "cpu"
    weight_version: int = 0
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 16
    role: Literal["main", "shadow"] = "main"


class RegisterReply(Message, tag="RegisterReply.v1"):
    """Router → worker: accepted registration (with the epoch now current)."""

    engine_id: EngineId
    epoch: int
    resumed_requests: int = 0
    """Interrupted requests the router is resubmitting to the new worker."""


class PingReply(Message, tag="PingReply.v1"):
    """Worker → caller of ``belayer.engine.<id>.ping``."""

    engine_id: EngineId
    epoch: int
    pid: int
    running: int
    waiting: int
    weight_version: int
    steps: int


# --- token log (JetStream) -----------------------------------------------------------------
class TokenLogChunk(Message, tag="TokenLogChunk.v1"):
    """Durable copy of a request's tokens (stream TOKENS), published every k tokens and at the
    end with ``Nats-Msg-Id = <request_id>:<chunk_index>`` so a replay never duplicates."""

    request_id: RequestId
    chunk_index: int
    start: int
    """Index of ``token_ids[0]`` among generated tokens."""
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    final: bool = False
    finish_reason: FinishReason | None = None


class AcceptedRequest(Message, tag="AcceptedRequest.v1"):
    """The request as the router accepted it (stream REQUESTS, msg id = request id)."""

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str | None = None
    engine_id: EngineId | None = None
    accepted_at: float = 0.0
    seed_filled: bool = False
    """True when the caller sent no seed and ``sampling.seed`` was filled in by the router (a
    resubmission without a seed is then the same request)."""


# --- status --------------------------------------------------------------------------------
class EngineInfo(msgspec.Struct, kw_only=True):
    """The router's view of one engine."""

    id: EngineId
    epoch: int
    worker_pid: int
    healthy: bool
    """Up: a live worker of the current epoch serves it (false while it is down — its worker
    failed and the next one has not registered yet — or unhealthy)."""
    device: str = "cpu"
    running: int = 0
    """Requests the router has on this engine."""
    weight_version: int = 0
    failures: int = 0
    state: str = ""
    """``up``, ``down`` (waiting for its next worker) or ``unhealthy`` (retired from
    placement); empty from a router that does not say."""
    holding: int = 0
    """Requests the worker holds as the router last heard from it (running + queued, counting
    work that did not come from this router)."""


RequestPhase = Literal["", "active", "finished", "unknown"]
"""What a router knows of one request (``RouterStatus.request``)."""


class RouterStatus(Message, tag="RouterStatus.v1"):
    """Reply of ``belayer.router.status``."""

    engines: list[EngineInfo]
    inflight: int
    finished: int
    token_log_chunk: int
    metrics: dict[str, int] = {}
    """Counters since the router started: ``tokens``, ``requests``, ``resumes``,
    ``regenerated_tokens``, ``adopted``, ``stale_batches``, ``engine_failures``."""
    router_id: IdOrEmpty = ""
    """This router process's incarnation (as stamped on what it streams); empty from an older
    router."""
    request: RequestPhase = ""
    """The state of the request the ``StatusRequest`` asked about: ``active`` (accepted, still
    generating or queued), ``finished`` (its result is kept for replay), ``unknown``; empty when
    none was asked about."""


class Ping(Message, tag="Ping.v1"):
    """Request on ``belayer.engine.<id>.ping``: answered with ``PingReply``."""


class StatusRequest(Message, tag="StatusRequest.v1"):
    """Request on ``belayer.router.status``: answered with ``RouterStatus``."""

    request_id: IdOrEmpty = ""
    """A request to report on (``RouterStatus.request``): how a client tells a long, quiet
    request from a router that went away."""


class EngineFailed(Message, tag="EngineFailed.v1"):
    """Shadow or supervisor → router (``belayer.router.engine_failed``): the main worker of
    ``engine_id`` at ``epoch`` died or hung. Idempotent per epoch."""

    engine_id: EngineId
    epoch: int
    pid: int = 0
    reason: str = ""
    """``exited``, ``hung``, ``heartbeat`` (remote ping missed)…"""
    detected_at: float = 0.0
    """Unix time of detection."""


class EngineStateRequest(Message, tag="EngineStateRequest.v1"):
    """Request on ``belayer.engine.<id>.state``: what the worker holds for these requests
    (a restarted router adopts running requests instead of regenerating them)."""

    request_ids: list[RequestId]


class HeldRequest(msgspec.Struct, kw_only=True):
    """A worker's copy of one request: every generated token it knows, held ones included."""

    request_id: RequestId
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: FinishReason | None = None


class EngineStateReply(Message, tag="EngineStateReply.v1"):
    """Reply of ``belayer.engine.<id>.state``: requests the worker runs or recently finished
    (unknown ids are simply absent)."""

    engine_id: EngineId
    epoch: int
    weight_version: int
    requests: list[HeldRequest]
