"""Events of the training side: the controller's agentic rollouts and the GRPO trainer (part of
the catalogue in ``schemas/events.py``)."""

from __future__ import annotations

from typing import ClassVar

from schemas.base import Id, IdOrEmpty
from schemas.env import CheckpointIdOrEmpty
from schemas.event_base import EventBase
from schemas.rollout import RolloutId


# --- controller (agentic rollouts) -----------------------------------------------------------
class ControllerEvent(EventBase, kw_only=True):
    """Published by the controller, about one rollout."""

    source: str = "controller"
    rollout_id: RolloutId
    """Rollout the event is about."""


class RolloutStarted(ControllerEvent, tag="RolloutStarted.v1"):
    """A rollout request was validated and its trajectories started."""

    kind: ClassVar[str] = "rollout_started"
    workload: str
    """Workload name."""
    trajectories: int
    """Slots (tasks × n)."""
    policy: str
    """Checkpoint policy."""


class RolloutDone(ControllerEvent, tag="RolloutDone.v1"):
    """Every slot of a rollout ended (published, or out of attempts)."""

    kind: ClassVar[str] = "rollout_done"
    trajectories_completed: int
    """Slots whose trajectory was published."""
    trajectories_failed: int
    """Attempts that ended `failed` (their slot got a fresh attempt)."""
    env_failures: int
    """Sandbox failures seen."""
    env_restores: int
    """Restores to a ready checkpoint."""
    restarts_from_scratch: int
    """Fresh sandboxes from the base image (context L_0)."""
    checkpoints: int
    """Ready checkpoints taken."""
    failures_injected: int
    """Injected failures."""
    failures_recovered: int
    """Injected failures seen recovered."""
    rollout_s: float
    """Wall time of the rollout (seconds)."""
    mean_reward: float | None
    """Mean reward of the published trajectories whose reward did not fail (None: none)."""


class TrajectoryFinished(ControllerEvent, tag="TrajectoryFinished.v1"):
    """A trajectory ended and was published to stream TRAJECTORIES."""

    kind: ClassVar[str] = "trajectory_finished"
    trajectory_id: Id
    """The trajectory (attempt) id."""
    finish_reason: str
    """`answered`, `max_turns`, `deadline`, `malformed` or `length`."""
    reward: float
    """Its reward."""
    turns: int
    """LLM turns it kept."""


class TrajectoryFailed(ControllerEvent, tag="TrajectoryFailed.v1"):
    """A trajectory attempt ended `failed` (recovery budget exhausted): it is not published."""

    kind: ClassVar[str] = "trajectory_failed"
    trajectory_id: Id
    """The trajectory (attempt) id."""
    reason: str
    """Why recovery gave up."""
    retry: bool
    """Whether the slot gets a fresh attempt."""


class SandboxFailure(ControllerEvent, tag="SandboxFailure.v1"):
    """An infrastructure failure of a trajectory's sandbox (never shown to the model)."""

    kind: ClassVar[str] = "sandbox_failure"
    trajectory_id: Id
    """The trajectory (attempt) id."""
    sandbox_id: IdOrEmpty
    """Its sandbox."""
    prefix: int
    """Actions done when it happened."""
    during: str
    """`create`, `exec`, `probe`, `reward` or `checkpoint`."""
    code: str
    """The error code (`sandbox_error`, `bus_unavailable`, `timeout`, …)."""
    error: str
    """The error message."""


class TrajectoryRestored(ControllerEvent, tag="TrajectoryRestored.v1"):
    """After a sandbox failure: the sandbox was restored to a ready checkpoint C_k and the
    context truncated to L_k, or restarted from the base image with L_0."""

    kind: ClassVar[str] = "trajectory_restored"
    trajectory_id: Id
    """The trajectory (attempt) id."""
    sandbox_id: Id
    """Its sandbox (a new one after a restart from scratch)."""
    prefix: int
    """k restored to (0 after a restart from scratch)."""
    checkpoint_id: CheckpointIdOrEmpty
    """C_k (empty after a restart from scratch)."""
    context_tokens: int
    """len(L_k) in tokens."""
    seconds: float
    """Time from the failure to the restored sandbox."""
    from_scratch: bool
    """True for a restart from the base image."""


class FailureInjected(ControllerEvent, tag="FailureInjected.v1"):
    """The controller injected a failure (`belayer rollout --inject`)."""

    kind: ClassVar[str] = "failure_injected"
    injection: str
    """The spec (`sandbox-kill@turn=3`)."""
    fault: str
    """Its kind (`sandbox-kill`, `sandbox-pause`, `worker-kill`, `controller-kill`)."""
    trajectory_id: IdOrEmpty
    """The trajectory it hit (empty for none in particular)."""
    target: str
    """What was broken: a container id, `pid <n>`."""


class FailureRecovered(ControllerEvent, tag="FailureRecovered.v1"):
    """An injected failure was recovered from (sandbox restored, engine back up, controller
    restarted and its rollout adopted)."""

    kind: ClassVar[str] = "failure_recovered"
    injection: str
    """The spec."""
    trajectory_id: IdOrEmpty
    """The trajectory it hit (empty for none in particular)."""
    seconds: float
    """From injection to recovery."""


class TrajectoriesAdopted(ControllerEvent, tag="TrajectoriesAdopted.v1"):
    """A (re)started controller took over a rollout's in-flight trajectories from their
    durable ready prefix."""

    kind: ClassVar[str] = "trajectories_adopted"
    trajectory_ids: list[Id]
    """The attempts resumed."""
    incarnation: int
    """The controller incarnation that adopted them (2 after the first restart)."""


# --- trainer ---------------------------------------------------------------------------------
class TrainerEvent(EventBase, kw_only=True):
    """Published by the trainer."""

    source: str = "trainer"


class TrainStepStarted(TrainerEvent, tag="TrainStepStarted.v1"):
    """A GRPO update starts: its batch is fixed (and its plan durable)."""

    kind: ClassVar[str] = "train_step_started"
    step: int
    """The step being trained (1 for the first)."""
    base_version: int
    """Weight version the update starts from (the rollouts' version, on-policy)."""
    samples: int
    """Trajectories in the batch."""
    replay: bool
    """True when a restarted trainer redoes a step from its durable plan."""


class UpdateMetrics(TrainerEvent, kw_only=True):
    """What one GRPO update measured (``services.trainer.update.grpo_step`` returns it): the
    fields a ``TrainStep`` starts with, declared once here. Not an event of its own (no tag):
    the trainer publishes them as part of its ``TrainStep``, with the checkpoint and the push."""

    step: int
    """Steps done."""
    version: int
    """Weight version of the updated weights (base + 1)."""
    loss: float
    """Mean GRPO loss per optimiser step."""
    reward_mean: float
    """Mean reward of the batch."""
    reward_std: float
    """Reward standard deviation over the batch (population)."""
    samples: int
    """Trajectories trained on."""
    groups: int
    """GRPO groups (tasks) in the batch."""
    tokens: int
    """Model tokens trained on (loss-mask ones)."""
    logprob_diff_max: float
    """Largest |training − rollout| log-probability over the checked model tokens."""
    logprob_diff_mean: float
    """Mean |training − rollout| log-probability over the checked model tokens."""
    unchecked_tokens: int
    """Model tokens whose generating weights were gone (compared with nothing)."""
    clip_low: float
    """Share of model tokens clipped below (ratio < 1 − eps_low, negative advantage)."""
    clip_high: float
    """Share of model tokens clipped above (ratio > 1 + eps_high, positive advantage)."""
    kl: float
    """Mean k3 KL to the reference policy (0 when beta is 0)."""
    grad_norm: float
    """Gradient norm before clipping (last optimiser step)."""
    lr: float
    """Learning rate of the last optimiser step."""
    recompute_s: float
    """Seconds recomputing log-probabilities (agreement check and old/ref log-probs)."""
    train_s: float
    """Seconds of forward/backward/optimiser work."""
    logprob_tokens_compared: int = 0
    """Model tokens whose training log-probability was compared with the engine's (counted
    where compared; ``logprob_diff_*`` mean nothing when it is 0)."""
    trajectory_ids: list[Id] = []
    """The trajectories trained on, in training order (what ``trajectories_lost`` counts
    against the slots a run submitted)."""


class TrainStep(UpdateMetrics, kw_only=True, tag="TrainStep.v1"):
    """A GRPO update finished, with its metrics (one per step; the run's metrics log)."""

    kind: ClassVar[str] = "train_step"
    checkpoint_s: float
    """Seconds writing the checkpoint (0 when this step wrote none)."""
    push_s: float
    """Seconds pushing the new weights to the weight store."""
    step_s: float
    """Wall time of the whole step, batch fixed to weights pushed."""
    checkpointed: bool
    """A checkpoint holds this step (its trajectories are acked)."""
    replay: bool
    """Redone from a durable plan after a restart."""
    weights_sha256: str = ""
    """sha256 of the updated weights, names sorted, each name, dtype, shape and raw bytes
    (equal: bitwise-equal weights); empty from an older trainer."""
    batch_sha256: str = ""
    """sha256 of the batch in training order: each sample's slot, index, tokens, loss mask,
    weight versions, reward and temperature (no ids: they name the run); empty from an older
    trainer."""
    republished: bool = False
    """Published again by a restarted trainer from its checkpoint: the first publication may
    have been lost (the trainer was killed between the step's checkpoint and this event). Its
    fields are the checkpoint's record of the step, its ``version`` the checkpoint's weights'
    (as the store numbers them at the resume); ``checkpoint_s`` and ``push_s`` are 0 (not
    known when the record was written) and ``step_s`` runs up to the checkpoint. A consumer
    that counts steps counts a step once (the first publication may have arrived)."""


class LogprobMismatch(TrainerEvent, tag="LogprobMismatch.v1"):
    """Training and inference disagree: a rollout token's log-probability recomputed under the
    weights that generated it differs from the engine's by more than the configured bound
    (an error: ``alert`` true; the step still trains)."""

    kind: ClassVar[str] = "logprob_mismatch"
    step: int
    """The step whose batch disagreed."""
    version: int
    """Weight version of the rollouts checked."""
    logprob_diff_max: float
    """The largest difference."""
    logprob_diff_mean: float
    """The mean difference."""
    bound: float
    """The configured bound (``logprob_diff_bound``)."""
    alert: bool = True
    """Always true: this needs a look."""


class TrajectoryRefused(TrainerEvent, tag="TrajectoryRefused.v1"):
    """The trainer acked a trajectory without training on it."""

    kind: ClassVar[str] = "trajectory_refused"
    trajectory_id: IdOrEmpty
    """Its id (for a malformed record the last token of its subject; empty when that is not a
    valid id)."""
    reason: str
    """`malformed` (sent to the dead-letter subject), `stale` (older than `max_staleness`
    allows), `duplicate` (its group slot is taken), `invalid` (slot outside the group), or —
    sent to the dead-letter subject too — `poison` (the update fails on it alone),
    `group_dropped` (a group mate is poison: a group trains whole or not at all) or
    `step_failed` (the update failed `step_attempts` times on its batch)."""
    detail: str
    """What was wrong."""
    stream_seq: int
    """Its sequence number in stream TRAJECTORIES."""


class TrainerCheckpointed(TrainerEvent, tag="TrainerCheckpointed.v1"):
    """A trainer checkpoint (model, optimiser, scheduler, RNG, trained ids) is durable; the
    trajectories of the steps it holds are acked after it."""

    kind: ClassVar[str] = "trainer_checkpointed"
    step: int
    """Steps the checkpoint holds."""
    version: int
    """Weight version of its weights."""
    trajectories: int
    """Trajectory ids it records as trained."""
    seconds: float
    """Time to write it."""
    path: str
    """Its directory."""


class TrainerResumed(TrainerEvent, tag="TrainerResumed.v1"):
    """A (re)started trainer continued from its latest checkpoint."""

    kind: ClassVar[str] = "trainer_resumed"
    step: int
    """Steps the checkpoint held."""
    version: int
    """Weight version of the checkpoint's weights."""
    store_version: int
    """Version the weight store had current at resume."""
    trained: int
    """Trajectory ids already trained on (never trained again)."""
    replay_steps: int
    """Steps with a durable plan beyond the checkpoint, to redo from the same trajectories."""
    pushed: bool
    """The checkpoint's weights were pushed at resume (the push had not happened)."""
