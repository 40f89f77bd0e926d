"""Lifecycle and recovery events, one typed message per kind.

An event is published on ``belayer.events.<kind>`` and persisted in stream ``EVENTS``. ``kind``
is a class constant (``HandoverComplete.kind == "handover_complete"``), not a wire field: on the
wire the ``type`` tag (``HandoverComplete.v1``) names the event, and the subject's last token is
its kind. Decode any event with ``AnyEvent`` (or the one type a subscriber expects).

Events *inform*: they record what happened. A receiver must not treat one as a command from
whoever published it. ``docs/protocol.md`` §6 is the catalogue (checked against this module).
"""

from __future__ import annotations

from typing import ClassVar, Literal, get_args

from schemas.env import CheckpointId, CheckpointInfo, SandboxId
from schemas.event_base import (
    EngineEvent,
    EventBase,
    KvArenaEvent,
    RouterEvent,
    SupervisorEvent,
    WeightStoreEvent,
)
from schemas.events_training import (
    FailureInjected,
    FailureRecovered,
    LogprobMismatch,
    RolloutDone,
    RolloutStarted,
    SandboxFailure,
    TrainerCheckpointed,
    TrainerResumed,
    TrainStep,
    TrainStepStarted,
    TrajectoriesAdopted,
    TrajectoryFailed,
    TrajectoryFinished,
    TrajectoryRefused,
    TrajectoryRestored,
)
from schemas.node import RunId
from schemas.serving import EngineId, RequestId


# --- supervisor ------------------------------------------------------------------------------
class NodeReady(SupervisorEvent, tag="NodeReady.v1"):
    """Every service of the node is up and the bus checks passed."""

    kind: ClassVar[str] = "node_ready"
    engines: list[EngineId]
    """Engine ids the node serves."""
    run_id: RunId
    """Id of this node run (names its shared-memory segments and message ids)."""


class ServiceExited(SupervisorEvent, tag="ServiceExited.v1"):
    """A supervised process exited without being asked to."""

    kind: ClassVar[str] = "service_exited"
    name: str
    """Process name (``router``, ``worker-e0``, ``shadow-e1``, …)."""
    code: int | None
    """Its exit status (negative: killed by that signal)."""
    pid: int | None
    """Its pid."""
    ran_s: float
    """How long it ran (seconds)."""


class ServiceRestarted(SupervisorEvent, tag="ServiceRestarted.v1"):
    """The supervisor started a process again after it exited (with backoff)."""

    kind: ClassVar[str] = "service_restarted"
    name: str
    """Process name."""
    pid: int | None = None
    """Pid of the new process (``None`` when not known yet)."""
    restarts: int = 0
    """Restarts of this service so far (0 when not counted: engine workers)."""
    mode: str = ""
    """``cold``: an engine's main worker restarted from scratch (baseline mode, or no
    handover in time); empty otherwise."""


class ResidualKilled(SupervisorEvent, tag="ResidualKilled.v1"):
    """After a handover the old (hung) main worker was still alive: the supervisor killed it."""

    kind: ClassVar[str] = "residual_killed"
    engine_id: EngineId
    """Engine whose old worker it was."""
    pid: int | None
    """Pid of the killed process."""


class EngineRetired(SupervisorEvent, tag="EngineRetired.v1"):
    """The router lists the engine unhealthy (``router.status``): the supervisor stopped its
    worker and shadow and restarts neither."""

    kind: ClassVar[str] = "engine_retired"
    engine_id: EngineId
    """Engine retired."""
    reason: str
    """The router's reason (``repeated failure``)."""


class HandoverFailed(SupervisorEvent, tag="HandoverFailed.v1"):
    """A shadow's takeover was not confirmed — the shadow exited first, or it was not the
    engine's registered worker within ``handover_timeout_s``: the supervisor restarts the
    engine's main worker cold (killing the old one if it still runs)."""

    kind: ClassVar[str] = "handover_failed"
    engine_id: EngineId
    """Engine whose handover failed."""
    reason: str
    """``shadow_exited`` (the shadow died during the takeover) or ``deadline`` (not confirmed
    within ``handover_timeout_s``; the stuck shadow is killed and started again)."""
    shadow_pid: int | None
    """Pid of the shadow that was taking over."""
    old_pid: int | None
    """Pid of the main worker it was to replace."""
    waited_s: float
    """Seconds from the start of the handover to the decision."""


# --- workers and shadows ---------------------------------------------------------------------
class WorkerReady(EngineEvent, tag="WorkerReady.v1"):
    """A main worker started cold is registered and serving."""

    kind: ClassVar[str] = "worker_ready"
    epoch: int
    """Epoch it claimed."""
    pid: int
    """Its pid."""
    attach_s: float
    """Seconds to map the weights and the KV arena."""
    build_warm_s: float
    """Seconds to build and warm up the engine."""


class ShadowReady(EngineEvent, tag="ShadowReady.v1"):
    """A shadow is prepared (weights and arena mapped, engine warm) and watches the main
    worker."""

    kind: ClassVar[str] = "shadow_ready"
    pid: int
    """The shadow's pid."""
    attach_s: float
    """Seconds to map the weights and the KV arena."""
    build_warm_s: float
    """Seconds to build and warm up the engine."""


class WorkerWeightsSwapped(EngineEvent, tag="WorkerWeightsSwapped.v1"):
    """A worker or shadow switched to a new weight version (a worker between two steps)."""

    kind: ClassVar[str] = "worker_weights_swapped"
    version: int
    """Weight version now in use."""
    pid: int
    """Pid of the process that switched."""
    role: str
    """``main`` or ``shadow``."""


# --- handover (published by the shadow) ------------------------------------------------------
class HandoverDetected(EngineEvent, tag="HandoverDetected.v1"):
    """Handover step 1: the shadow found the main worker dead or hung and told the router."""

    kind: ClassVar[str] = "handover_detected"
    old_pid: int
    """Pid of the failed main worker."""
    old_epoch: int
    """Its epoch."""
    verdict: str
    """``dead`` (the process is gone) or ``hung`` (its heartbeat went stale)."""
    heartbeat_age_s: float
    """Age of its last heartbeat when detected (seconds)."""
    t_detect: float
    """Unix time of the detection."""


class HandoverHealthOk(EngineEvent, tag="HandoverHealthOk.v1"):
    """Handover step 2: the shadow's engine, the weight store and the KV arena answer."""

    kind: ClassVar[str] = "handover_health_ok"
    forward_s: float
    """Duration of the shadow's test forward pass (seconds)."""
    residual_killed: bool
    """Whether the old worker was still alive (hung) and the shadow killed it."""
    t_health: float
    """Unix time the checks passed."""


class HandoverFlushed(EngineEvent, tag="HandoverFlushed.v1"):
    """Handover step 3: the shadow claimed the new epoch (compare-and-set) and the KV arena was
    zeroed under exactly that epoch."""

    kind: ClassVar[str] = "handover_flushed"
    t_flush: float
    """Unix time of the flush."""


class HandoverReady(EngineEvent, tag="HandoverReady.v1"):
    """Handover step 4: the shadow serves under the epoch it claimed at step 3."""

    kind: ClassVar[str] = "handover_ready"
    epoch: int
    """The new epoch."""
    t_ready: float
    """Unix time it became ready."""


class HandoverComplete(EngineEvent, tag="HandoverComplete.v1"):
    """Handover step 5: the shadow registered with the router as the engine's main worker."""

    kind: ClassVar[str] = "handover_complete"
    epoch: int
    """The new epoch."""
    pid: int
    """Pid of the new main worker (the former shadow)."""
    old_pid: int
    """Pid of the failed main worker."""
    old_epoch: int
    """Epoch of the failed main worker."""
    detect_to_registered_s: float
    """Seconds from detection to registration."""
    t_detect: float
    """Unix time of the detection (step 1)."""
    t_health: float
    """Unix time the health checks passed (step 2)."""
    t_flush: float
    """Unix time of the arena flush (step 3)."""
    t_ready: float
    """Unix time the engine was ready under the new epoch (step 4)."""
    t_registered: float
    """Unix time of the registration (step 5)."""


# --- router ----------------------------------------------------------------------------------
class EngineRegistered(RouterEvent, tag="EngineRegistered.v1"):
    """A worker registered as the engine's main worker under a new epoch."""

    kind: ClassVar[str] = "engine_registered"
    epoch: int
    """Its epoch."""
    pid: int
    """Its pid."""
    old_pid: int | None = None
    """Pid of the worker it replaced (``None`` for the engine's first worker)."""
    old_epoch: int | None = None
    """Epoch of the worker it replaced (``None`` for the engine's first worker)."""


class RequestsResumed(RouterEvent, tag="RequestsResumed.v1"):
    """The requests of a replaced worker were resumed on the engine's new worker, from the
    tokens already held."""

    kind: ClassVar[str] = "requests_resumed"
    epoch: int
    """Epoch of the new worker."""
    count: int
    """Number of requests resumed."""
    held_tokens: int
    """Tokens they held in all (not generated again)."""
    request_ids: list[RequestId]
    """The requests resumed."""


class ResumedFirstToken(RouterEvent, tag="ResumedFirstToken.v1"):
    """Resumed requests received their first new token from the engine's new worker."""

    kind: ClassVar[str] = "resumed_first_token"
    epoch: int
    """Epoch of the new worker."""
    request_ids: list[RequestId]
    """The resumed requests whose first new token came in this step."""
    seconds: list[float]
    """For each of them: from the router taking the old worker down (``engine_failed``) to
    that token reaching the router (which forwards it to the caller at once)."""


class EngineFailedEvent(RouterEvent, tag="EngineFailedEvent.v1"):
    """The router took the engine down: its worker was reported failed (by the shadow, the
    supervisor or the router's own heartbeat). Its requests wait for the next worker."""

    kind: ClassVar[str] = "engine_failed"
    epoch: int
    """Epoch of the failed worker."""
    pid: int
    """Pid of the failed worker."""
    reason: str
    """``exited``, ``hung``, ``heartbeat``, ``replaced``, ``submit failed``, …"""
    request_ids: list[RequestId]
    """Requests it held (they wait for the engine's next worker)."""


class EngineRecovered(RouterEvent, tag="EngineRecovered.v1"):
    """A down engine's worker answered pings after all (the router's own suspicion was a false
    alarm): the engine is up again and gets its requests back."""

    kind: ClassVar[str] = "engine_recovered"
    epoch: int
    """The worker's epoch."""
    pid: int
    """The worker's pid."""
    requests: int
    """Number of requests it got back."""
    request_ids: list[RequestId]
    """The requests it got back."""


class EngineUnhealthy(RouterEvent, tag="EngineUnhealthy.v1"):
    """A second failure inside the failure window: the engine takes no more work and its
    requests were moved to healthy engines."""

    kind: ClassVar[str] = "engine_unhealthy"
    reason: str
    """Why (``repeated failure``)."""
    moved_requests: int
    """Number of requests moved to other engines."""
    request_ids: list[RequestId]
    """The requests moved."""
    alert: bool = True
    """Always true: an operator should look at the device."""


class StaleOutputRejected(RouterEvent, tag="StaleOutputRejected.v1"):
    """A step batch from a worker that is not the engine's current one (an older epoch, a down
    engine) was dropped: it reached no caller."""

    kind: ClassVar[str] = "stale_output_rejected"
    epoch: int
    """Epoch the batch was stamped with."""
    pid: int
    """Pid of the worker that sent it."""
    current_epoch: int | None
    """The engine's current epoch (``None``: an unknown engine)."""
    request_ids: list[RequestId]
    """Requests the dropped batch carried tokens for."""


class StaleFailureReport(RouterEvent, tag="StaleFailureReport.v1"):
    """A failure report about a worker that was already replaced was ignored."""

    kind: ClassVar[str] = "stale_failure_report"
    epoch: int
    """Epoch the report was about."""
    current_epoch: int
    """The engine's current epoch."""
    pid: int
    """Pid the report was about."""


class RegistrationRejected(RouterEvent, tag="RegistrationRejected.v1"):
    """A worker tried to register under an epoch it did not claim (answered ``conflict``)."""

    kind: ClassVar[str] = "registration_rejected"
    epoch: int
    """Epoch it tried to register under."""
    claimed_epoch: int
    """The epoch actually claimed for the engine."""
    pid: int
    """Its pid."""


class RequestsAdopted(RouterEvent, tag="RequestsAdopted.v1"):
    """After a router restart, a live worker reported the requests it still runs; the router
    took over those whose tokens extend its log."""

    kind: ClassVar[str] = "requests_adopted"
    count: int
    """Number of requests the worker reported holding."""
    request_ids: list[RequestId]
    """The requests adopted (not generated again)."""


class AdoptMismatch(RouterEvent, tag="AdoptMismatch.v1"):
    """After a router restart, a worker's copy of a request disagreed with the token log: the
    request is resumed from the log instead."""

    kind: ClassVar[str] = "adopt_mismatch"
    request_id: RequestId
    """The request."""
    logged: int
    """Tokens in the log."""


class StalledRequestReconciled(RouterEvent, tag="StalledRequestReconciled.v1"):
    """A request got no token between two heartbeats and its worker's copy said why: the
    worker had finished it (the step batch with its last tokens was lost: they are taken from
    the copy and the request finishes), or had no copy, a different one or one it dropped (a lost
    submit: it was resubmitted from the tokens held)."""

    kind: ClassVar[str] = "stalled_request_reconciled"
    request_id: RequestId
    """The request."""
    held: int
    """Tokens the router held."""
    recovered: int
    """Tokens taken from the worker's finished copy (0 when resubmitted)."""
    outcome: Literal["finished", "resubmitted"]
    """What the router did."""


class TokenGapResubmitted(RouterEvent, tag="TokenGapResubmitted.v1"):
    """A step batch was lost (the next one starts past the tokens held): the request was
    resubmitted from the tokens held."""

    kind: ClassVar[str] = "token_gap_resubmitted"
    request_id: RequestId
    """The request."""
    held: int
    """Tokens the router held."""
    start: int
    """Index the worker's batch started at."""


class RequestFailed(RouterEvent, tag="RequestFailed.v1"):
    """The worker reported an error for a request: it finished with ``error``."""

    kind: ClassVar[str] = "request_failed"
    request_id: RequestId
    """The request."""
    error: str
    """The worker's error message."""


# --- memory owners and environment -----------------------------------------------------------
class WeightsUpdated(WeightStoreEvent, tag="WeightsUpdated.v1"):
    """A pushed weight version is now current: a hint for workers and shadows, which switch to
    the version KV ``weight_version`` marks current."""

    kind: ClassVar[str] = "weights_updated"
    version: int
    """The new current version."""
    base_version: int
    """The version the push was based on."""
    checksum: str
    """Checksum of the new weights (as in its ``WeightManifest``)."""
    bytes: int
    """Size of the weights."""
    seconds: float
    """Time to store and publish them."""


class KvFlushed(KvArenaEvent, tag="KvFlushed.v1"):
    """An engine's KV arena was zeroed for a new epoch (handover step 3)."""

    kind: ClassVar[str] = "kv_flushed"
    generation: int
    """The arena's generation after the flush."""
    epoch: int
    """Epoch the flush was requested under."""
    ms: float
    """Duration of the flush (milliseconds)."""


class CheckpointReady(EventBase, tag="CheckpointReady.v1"):
    """A sandbox checkpoint is complete and is the sandbox's ready checkpoint now."""

    kind: ClassVar[str] = "checkpoint_ready"
    checkpoint: CheckpointInfo
    """The checkpoint (as the ``checkpoint`` request returned it)."""


class SandboxRestored(EventBase, tag="SandboxRestored.v1"):
    """A sandbox was rolled back to a ready checkpoint in a fresh container (``restore``)."""

    kind: ClassVar[str] = "sandbox_restored"
    sandbox_id: SandboxId
    """The sandbox."""
    checkpoint_id: CheckpointId
    """The checkpoint now running."""
    prefix: int
    """Actions the checkpoint holds."""
    seconds: float
    """Duration of the restore (every candidate tried)."""
    bytes: int
    """Size of the checkpoint restored (files and processes)."""
    method: str
    """``runtime``, ``docker`` or ``layer`` (as ``EnvRestored.method``)."""


AnyEvent = (
    NodeReady
    | ServiceExited
    | ServiceRestarted
    | ResidualKilled
    | EngineRetired
    | HandoverFailed
    | WorkerReady
    | ShadowReady
    | WorkerWeightsSwapped
    | HandoverDetected
    | HandoverHealthOk
    | HandoverFlushed
    | HandoverReady
    | HandoverComplete
    | EngineRegistered
    | RequestsResumed
    | ResumedFirstToken
    | EngineFailedEvent
    | EngineRecovered
    | EngineUnhealthy
    | StaleOutputRejected
    | StaleFailureReport
    | RegistrationRejected
    | RequestsAdopted
    | AdoptMismatch
    | TokenGapResubmitted
    | StalledRequestReconciled
    | RequestFailed
    | WeightsUpdated
    | KvFlushed
    | CheckpointReady
    | SandboxRestored
    | RolloutStarted
    | RolloutDone
    | TrajectoryFinished
    | TrajectoryFailed
    | SandboxFailure
    | TrajectoryRestored
    | FailureInjected
    | FailureRecovered
    | TrajectoriesAdopted
    | TrainStepStarted
    | TrainStep
    | LogprobMismatch
    | TrajectoryRefused
    | TrainerCheckpointed
    | TrainerResumed
)
"""Every event type: decode any event with it."""

EVENT_TYPES: tuple[type[EventBase], ...] = get_args(AnyEvent)
"""The members of ``AnyEvent``, in catalogue order."""
