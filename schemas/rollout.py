"""Messages of the controller (``belayer.rollout.*``), the trajectory record it publishes to
stream ``TRAJECTORIES``, and the durable state it keeps in KV (``rollouts``,
``trajectory_prefix``) so a restarted controller resumes its trajectories from their ready prefix.

A rollout runs ``n`` samples of each task; each (task, sample) *slot* runs attempts until one
ends other than ``failed`` (a failed attempt is never published: the slot gets a fresh one, so
GRPO groups stay full). A trajectory is one attempt. Token arrays of a trajectory are split as
the trainer needs them: ``prompt_ids`` (L_0) and ``response_ids`` (everything after it: model
tokens and the observation turns between them), with ``loss_mask``, ``logprobs`` and
``weight_versions`` parallel to ``response_ids``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas.base import Id, IdOrEmpty, Message
from schemas.env import CheckpointId
from schemas.serving import SamplingParams, Seed, TokenId

RolloutId = Id
TaskId = Id
"""A task's id (``math-basic_arithmetic-train-3``, a SWE-Gym ``instance_id``): it names
trajectories, which become subject tokens."""
"""Rollout id (``schemas.base.Id``); trajectory ids start with it."""

FinishReason = Literal["answered", "max_turns", "deadline", "failed", "malformed", "length"]
"""How a trajectory ended: ``answered`` (a final answer or the submit command), ``max_turns``,
``deadline`` (its wall-clock budget ran out), ``malformed`` (too many unparseable responses in a
row), ``length`` (the context reached the model's limit), ``failed`` (infrastructure recovery
exhausted its budget: never published)."""

FaultKind = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9-]{0,31}\Z")]
"""An injection kind (``sandbox-kill``, ``sandbox-pause``, ``worker-kill``, ``controller-kill``;
the controller refuses kinds it does not know)."""

Turns = Annotated[int, msgspec.Meta(ge=1, le=1000)]
Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=86_400.0)]
"""A positive, finite duration of at most a day."""


class FaultSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One failure injection (``KIND@WHEN`` on the command line)."""

    kind: FaultKind
    """What to break: ``sandbox-kill`` (docker kill of the trajectory's container),
    ``sandbox-pause`` (docker pause: a hang), ``worker-kill`` (SIGKILL of a rollout worker),
    ``controller-kill`` (SIGKILL of the controller itself)."""
    trigger: Annotated[str, msgspec.Meta(pattern=r"^[a-z]{1,16}\Z")]
    """``turn``: after the ``value``-th action; ``p``: with probability ``value`` per
    environment step; ``s``: ``value`` seconds into the rollout (the controller refuses
    triggers it does not know)."""
    value: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
    """The turn number, probability or seconds."""
    target: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """Trajectory slot index ``#i`` (``turn=T/i``); -1: every trajectory (sandbox kinds) or the
    first to get there (process kinds)."""
    text: str = ""
    """The spec as written (``sandbox-kill@turn=3``), for events and summaries."""


PluginSpec = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,199}:[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
]
"""``package.module:attribute`` naming a user's function (``workloads.plugins``)."""


class RolloutRequest(Message, tag="RolloutRequest.v1"):
    """User → controller (``belayer.rollout.submit``): run ``n`` samples of each task."""

    workload: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^(?:[a-z][a-z0-9_-]{0,63}|[A-Za-z_][A-Za-z0-9_.]{0,199}:[A-Za-z_][A-Za-z0-9_]{0,63})\Z"
        ),
    ]
    """Workload name (``math``, ``swe``, an installed package's entry point) or a
    ``module:factory`` plugin the node enables (``belayer up --workload-plugin``); unknown →
    ``not_found``, a plugin the node does not enable → ``unauthorized``."""
    rollout_id: IdOrEmpty = ""
    """Caller-chosen id (resubmitting the same request is idempotent); empty: a fresh one."""
    task_ids: list[TaskId] = []
    """Tasks to run, by id; empty: the workload's first ``tasks`` tasks."""
    tasks: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 4
    """How many tasks when ``task_ids`` is empty."""
    dataset: str = ""
    """A dataset for the workload's loader (DAPO-style math, SWE-Gym instances; a ``.jsonl``,
    ``.json`` or ``.parquet`` file or a ``datasets`` ``save_to_disk`` directory); empty: the
    workload's built-in tasks."""
    prompt_column: Annotated[str, msgspec.Meta(max_length=200)] = ""
    """The dataset's prompt column (a string or a list of ``{role, content}``); set, a math
    dataset is read as a ``table`` (``workloads.table``). Empty: the loader's own."""
    answer_column: Annotated[str, msgspec.Meta(max_length=200)] = ""
    """The dataset's answer column (a string or a number; ``a.b``: key ``b`` of column ``a``);
    set, a math dataset is read as a ``table``. Empty: the loader's own."""
    n: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    """Samples per task (the GRPO group size)."""
    sampling: SamplingParams = msgspec.field(
        default_factory=lambda: SamplingParams(temperature=1.0, max_tokens=256)
    )
    """Sampling of every LLM turn (``max_tokens`` per response; ``seed`` is ignored: each
    generation's seed is derived from ``seed``)."""
    seed: Seed = 0
    """Root seed: sample s of a task uses ``derive_seed(seed, s)``, its g-th generation
    ``derive_seed(that, g)``."""
    max_turns: Turns = 20
    """LLM turns per trajectory before it ends as ``max_turns``."""
    deadline_s: Seconds = 900.0
    """Wall-clock budget of one trajectory attempt (ends as ``deadline``)."""
    policy: Annotated[str, msgspec.Meta(max_length=64)] = "risk-aware"
    """Checkpoint policy: ``never``, ``always``, ``risk-aware``, ``interval:N``, ``young-daly``."""
    failure_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] | None = None
    """λ (failures per second of exposure) for the policy; None: estimated from the failures
    it observes (a prior updated online, per environment image)."""
    failure_probability: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    """An oracle p_t: the failure probability of every environment step, told to the policy
    instead of its estimate (a benchmark passes the probability it injects); None: not told."""
    inject: list[FaultSpec] = []
    """Failures to inject (each is an event and is counted)."""
    concurrency: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    """Trajectories run at once; 0: the controller's default."""
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    """Attempts per slot before the slot counts as failed."""
    rewards: Annotated[list[PluginSpec], msgspec.Meta(max_length=16)] = []
    """Reward functions (``module:function``, TRL's shape: ``fn(prompts, completions,
    **columns) -> list[float | None]``) or reward services (``service:<name>``) scoring the
    trajectories instead of the workload's reward, each function one the node enables
    (``belayer up --reward-function``); empty: the reward services the workload declares
    (``rewards``), else its own reward. Functions score answer tasks only, services sandbox
    tasks too (docs/workloads.md, "Reward functions")."""
    reward_weights: Annotated[list[float], msgspec.Meta(max_length=16)] = []
    """One weight per reward function (TRL's ``reward_weights``); empty: all 1."""


class RolloutAccepted(Message, tag="RolloutAccepted.v1"):
    """Reply to ``RolloutRequest``: validated (workload, tasks, images) and started."""

    rollout_id: RolloutId
    trajectories: int
    """Slots: tasks × n."""
    task_ids: list[TaskId]
    """The tasks, in slot order (slot i = task i // n, sample i % n)."""
    existing: bool = False
    """True when the same request was already running or done (a resubmission)."""


class RolloutStatusRequest(Message, tag="RolloutStatusRequest.v1"):
    """User → controller (``belayer.rollout.status``): where a rollout stands."""

    rollout_id: RolloutId


class RolloutSummary(msgspec.Struct, kw_only=True):
    """Counts of one rollout (also the ``--json`` summary of ``belayer rollout``)."""

    trajectories: int = 0
    """Slots (tasks × n)."""
    trajectories_completed: int = 0
    """Slots whose trajectory was published."""
    trajectories_failed: int = 0
    """Attempts that ended ``failed`` (each slot then got a fresh attempt, up to its budget)."""
    slots_failed: int = 0
    """Slots that used up ``max_attempts`` without a published trajectory."""
    running: int = 0
    """Attempts in flight."""
    restored: int = 0
    """Published trajectories that went through at least one restore or restart."""
    reward_failures: int = 0
    """Published trajectories whose reward functions failed (``reward_error``)."""
    env_failures: int = 0
    """Sandbox (infrastructure) failures seen, all attempts."""
    env_restores: int = 0
    """Successful ``full_restore`` s to a ready checkpoint."""
    restarts_from_scratch: int = 0
    """Fresh sandboxes from the base image with context L_0 after a failure."""
    restarts_from_scratch_with_checkpoint: int = 0
    """Of those, restarts while a ready checkpoint existed (the target is 0)."""
    checkpoints: int = 0
    """Ready checkpoints taken."""
    checkpoint_failures: int = 0
    """Checkpoints that failed or timed out."""
    engine_handovers: int = 0
    """Worker handovers the trajectories' LLM requests rode through (router resumes)."""
    visible_checkpoint_s: float = 0.0
    """Seconds actions waited for a checkpoint (the critical-path part), summed."""
    checkpoint_s: float = 0.0
    """Seconds checkpoints took in all (mostly hidden in LLM bubbles)."""
    llm_s: float = 0.0
    env_s: float = 0.0
    rollout_s: float = 0.0
    """Wall time from acceptance to the last slot's end."""
    mean_reward: float | None = 0.0
    """Over published trajectories whose reward did not fail (``reward_failures``); ``None``
    when there is none (nothing was scored: not a mean of 0)."""
    failures_injected: int = 0
    failures_recovered: int = 0
    controller_restarts: int = 0
    """Controller incarnations that adopted this rollout after the first."""
    trajectory_s: float = 0.0
    """Wall time of every attempt summed (what ``visible_checkpoint_s`` is a part of)."""
    failure_p_estimate: float | None = None
    """The checkpoint policy's estimate, at the end, of the failure probability of one
    environment step of average length, from the failures it observed (over the node's
    images); None: no environment step."""
    failure_p_by_image: dict[str, float] = {}
    """The same estimate per environment image."""


class TrajectoryRow(msgspec.Struct, kw_only=True):
    """One attempt as ``belayer rollout`` lists it."""

    trajectory_id: Id
    task_id: TaskId
    slot: int
    attempt: int
    state: Literal["running", "finished", "failed"]
    finish_reason: FinishReason | None = None
    reward: float = 0.0
    turns: int = 0
    restores: int = 0
    restarts_from_scratch: int = 0
    checkpoints: int = 0
    sandbox_failures: int = 0
    detail: str = ""
    reward_error: str = ""
    """Why its reward functions failed (empty: they did not); see ``Trajectory.reward_error``."""


class RolloutResult(Message, tag="RolloutResult.v1"):
    """Reply to ``RolloutStatusRequest``."""

    rollout_id: RolloutId
    state: Literal["running", "done"]
    summary: RolloutSummary
    rows: list[TrajectoryRow] = []
    """Every attempt so far, in slot order."""
    workload: str = ""


# --- the trajectory record ----------------------------------------------------------------
class ActionRecord(msgspec.Struct, kw_only=True):
    """One action the trajectory kept (actions undone by a restore are not listed)."""

    turn: int
    """LLM turn (1-based) whose response held it."""
    prefix: int
    """Sandbox prefix index k it ran at (the number of actions before it)."""
    command: str
    exit_code: int
    env_s: float
    timed_out: bool = False
    """The agent's own command ran past its timeout (an ordinary observation)."""
    truncated: bool = False
    generation: int = 0
    """The LLM request (``<trajectory_id>-g<n>``) whose response held it."""


class PolicyDecision(msgspec.Struct, kw_only=True):
    """One checkpoint decision after an environment step, with all its inputs."""

    prefix: int
    policy: str
    checkpoint: bool
    reason: str
    p: float
    """p_t, the failure probability of the step."""
    regen_cost_s: float
    """C_t: LLM + env seconds since the last ready checkpoint."""
    benefit: float
    checkpoint_cost_s: float
    """c_t: estimated checkpoint cost."""
    q: float
    """q(x; c_t) from the observed LLM response times."""
    visible_cost: float
    elapsed_s: float = 0.0
    """x: how long the current LLM response had run at decision time."""


RecoveryKind = Literal[
    "sandbox_failure",
    "restore",
    "restore_failed",
    "restart_from_scratch",
    "checkpoint",
    "checkpoint_failed",
    "engine_handover",
    "injected",
    "adopted",
]


class RecoveryEntry(msgspec.Struct, kw_only=True):
    """One entry of a trajectory's recovery log."""

    kind: RecoveryKind
    turn: int
    """LLM turns so far when it happened."""
    prefix: int
    """Action boundary k it is about (for a restore: the k restored to)."""
    detail: str = ""
    seconds: float = 0.0
    ts: float = 0.0
    generation: int = 0
    """LLM requests made so far when it happened."""


class RecoveryLog(msgspec.Struct, kw_only=True):
    """What recovery did for one trajectory attempt."""

    engine_handovers: int = 0
    """Worker handovers its LLM requests rode through."""
    sandbox_failures: int = 0
    restores: int = 0
    restore_failures: int = 0
    restarts_from_scratch: int = 0
    restarts_from_scratch_with_checkpoint: int = 0
    """Restarts from scratch while a ready checkpoint was known (should stay 0)."""
    checkpoints: int = 0
    checkpoint_failures: int = 0
    decisions: list[PolicyDecision] = []
    entries: list[RecoveryEntry] = []


class Timings(msgspec.Struct, kw_only=True):
    """Seconds spent by one trajectory attempt (kept work and regenerated work alike)."""

    llm_s: float = 0.0
    env_s: float = 0.0
    visible_checkpoint_s: float = 0.0
    """Time the next action waited for a checkpoint (on the critical path)."""
    checkpoint_s: float = 0.0
    """Total checkpoint time (mostly overlapped with LLM responses)."""
    recovery_s: float = 0.0
    reward_s: float = 0.0
    total_s: float = 0.0


class Trajectory(Message, tag="Trajectory.v1"):
    """A finished trajectory, published to ``belayer.trajectories.<rollout_id>.<trajectory_id>``
    (stream ``TRAJECTORIES``, msg id = trajectory id)."""

    trajectory_id: Id
    rollout_id: RolloutId
    workload: str
    task_id: TaskId
    slot: int
    """Slot index i: task ``i // n``, sample ``i % n``."""
    sample: int
    """Sample index within the task's group."""
    attempt: int
    """0 for the slot's first attempt."""
    prompt_ids: list[TokenId]
    """L_0: the chat-formatted prompt up to the first assistant header."""
    response_ids: list[TokenId]
    """Everything after L_0: model tokens, and the observation turns between responses."""
    loss_mask: list[int]
    """Per response token: 1 on model tokens, 0 on observation/formatting tokens."""
    logprobs: list[float]
    """Per response token: the rollout log-probability (0.0 where the mask is 0)."""
    weight_versions: list[int]
    """Per response token: the weight version that produced it (-1 where the mask is 0)."""
    reward: float
    turns: int
    finish_reason: FinishReason
    actions: list[ActionRecord] = []
    timings: Timings = msgspec.field(default_factory=Timings)
    recovery: RecoveryLog = msgspec.field(default_factory=RecoveryLog)
    seed: int = 0
    """The sample's seed (``derive_seed(rollout seed, sample)``)."""
    policy: str = ""
    detail: str = ""
    """Why it finished (the answer found, the limit hit)."""
    reward_error: str = ""
    """Set when its reward functions raised or returned no reward (``reward_failed``): its
    ``reward`` is 0.0 and means nothing — the trainer gives it no advantage and leaves it out
    of its group's mean and std. Empty: the reward is the reward."""
    temperature: float = 1.0
    """Sampling temperature of its responses (the log-probabilities are at it)."""


# --- durable controller state (KV) ----------------------------------------------------------
class ReadyPrefix(msgspec.Struct, kw_only=True):
    """A ready checkpoint C_k and where L_k ends in the trajectory's arrays."""

    prefix: int
    """k: actions done when it was taken."""
    checkpoint_id: CheckpointId
    response_len: int
    """len(response_ids) of L_k."""
    actions_len: int
    turn: int
    """LLM turns done at k."""


class TrajectoryState(Message, tag="TrajectoryState.v1"):
    """KV ``trajectory_prefix``, key = trajectory id: the durable association (trajectory, k,
    C_k, L_k). The arrays hold L_k of the latest ready prefix (older ready prefixes are
    prefixes of it, listed in ``ready``); written at start, at every ready checkpoint, after
    every recovery and at the end."""

    trajectory_id: Id
    rollout_id: RolloutId
    slot: int
    attempt: int
    status: Literal["running", "finished", "failed"] = "running"
    sandbox_id: IdOrEmpty = ""
    ready: list[ReadyPrefix] = []
    """The chain of ready checkpoints of the current history, oldest first."""
    response_ids: list[TokenId] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    weight_versions: list[int] = []
    actions: list[ActionRecord] = []
    generations: int = 0
    """LLM requests made so far (names the next one; its seed comes from its turn)."""
    recovery: RecoveryLog = msgspec.field(default_factory=RecoveryLog)
    timings: Timings = msgspec.field(default_factory=Timings)
    fired: list[str] = []
    """Injections that already fired on this attempt (not repeated after a restore)."""
    row: TrajectoryRow | None = None
    """The attempt's outcome once it ended."""
    started_at: float = 0.0
    """Unix time the attempt started (its deadline counts from it, across controllers)."""
    env_steps: int = 0
    """Environment steps run so far, undone ones included (numbers the ``p`` draws)."""


class RolloutState(Message, tag="RolloutState.v1"):
    """KV ``rollouts``, key = rollout id: the request as accepted and its progress."""

    request: RolloutRequest
    task_ids: list[TaskId]
    accepted_at: float
    state: Literal["running", "done"] = "running"
    attempts: list[int] = []
    """Per slot: the attempt now running or last run."""
    fired: list[str] = []
    """Rollout-wide injections that fired (process kills, ``s=`` injections)."""
    failures_injected: int = 0
    failures_recovered: int = 0
    pending_recovery: list[str] = []
    """Injected process kills not yet seen recovered (a controller kill is recovered when the
    next incarnation adopts the rollout)."""
    incarnations: int = 1
    finished_at: float = 0.0
    summary: RolloutSummary | None = None
