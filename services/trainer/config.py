"""Settings of the GRPO trainer service (its fields are ``python -m services.trainer``'s flags;
the supervisor forwards them). Importable without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.device import DeviceChoice, resolve_device
from common.errors import FatalError
from common.service import ServiceConfig
from common.training_config import OptimConfig

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
"""TRL's ``loss_type`` values (``GrpoConfig.loss_type``)."""


@dataclass(frozen=True)
class GrpoConfig:
    """The GRPO objective; names and defaults follow Hugging Face TRL's ``GRPOConfig``
    (``eps_high`` is the DAPO paper's 0.28; see ``services/trainer/core.py``)."""

    loss_type: LossType = "dapo"
    """How per-token losses are aggregated (TRL's ``loss_type``)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group's std, the batch's, or not at all."""
    eps_low: float = 0.2
    """Lower clip: ratios below ``1 - eps_low`` stop pushing a negative advantage."""
    eps_high: float = 0.28
    """Upper clip: ratios above ``1 + eps_high`` stop pushing a positive advantage."""
    beta: float = 0.0
    """KL coefficient towards the reference policy (the weights the run started from; k3)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """``token``: one ratio per token; ``sequence``: GSPO's one ratio per sequence."""
    max_completion_length: int = 0
    """``dr_grpo``'s constant divisor; 0: the longest response of the step."""
    minibatches: int = 1
    """Optimiser steps per rollout batch (1: one update per batch, TRL's default)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (gradients accumulate over a mini-batch)."""

    def __post_init__(self) -> None:
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(
                f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}"
            )
        if self.beta < 0 or self.max_completion_length < 0:
            raise ValueError("beta and max_completion_length must be >= 0")
        if self.minibatches < 1 or self.micro_batch_size < 1:
            raise ValueError("minibatches and micro_batch_size must be >= 1")


@dataclass(frozen=True)
class TrainerConfig(ServiceConfig):
    """How the trainer consumes trajectories, updates and checkpoints."""

    run_id: str = "dev"
    """The node's run id (names the shm files of pushed weights; stamped on checkpoints)."""
    checkpoint_dir: Path = Path(".belayer/trainer")
    """Checkpoints (``step-<N>/``) and step plans (``plans/``) of this training run."""
    group_size: int = 4
    """Samples per task (``n``): one GRPO group."""
    groups_per_step: int = 2
    """Tasks per training batch: a batch is ``groups_per_step × group_size`` trajectories."""
    max_staleness: int = 0
    """Train on samples at most this many weight versions old (0: on-policy); older ones are
    refused (acked, counted, an event)."""
    checkpoint_every: int = 1
    """Checkpoint every N steps; a step's trajectories are acked once a checkpoint holds it."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept on disk."""
    resume: bool = False
    """Continue from the latest checkpoint under ``checkpoint_dir`` even when another node run
    wrote it (a restart within the same node run always continues its own checkpoints);
    without it such a directory is refused."""
    max_steps: int = 0
    """Stop consuming after this many steps (0: no limit)."""
    logprob_diff_bound: float = 1e-4
    """Largest training-vs-rollout log-probability difference accepted on a model token; above
    it a ``logprob_mismatch`` error event is published (the step still trains). With
    ``deterministic`` the bound is 0: any difference is an error."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (their log-probabilities are at it), for records
    that do not carry one; 0 (greedy) is scored at 1."""
    deterministic: bool = False
    """The batch-invariant training forward (bitwise equal to a deterministic engine's)."""
    threads: int = 1
    """torch intra-op threads (1: bitwise reproducible updates); each rank's with ``procs``."""
    procs: int = 1
    """Data-parallel ranks of the update (``torch.distributed``, gloo on CPU): this process is
    rank 0 and starts the others; each computes its share of every micro-batch, gradients are
    summed, rank 0 checkpoints and pushes. 1: one process."""
    device: DeviceChoice = "cpu"
    """Where the update computes: ``cpu``; ``cuda`` (refused at start without a CUDA device;
    one process, not deterministic: the data-parallel ranks and the batch-invariant training
    forward are CPU-only here); ``auto`` (``cuda`` when torch sees one)."""
    pad_token_id: int = 0
    """Token id used for padding (masked out; any id works)."""
    consumer: str = "trainer"
    """Durable JetStream consumer name on stream TRAJECTORIES."""
    subject_filter: str = ""
    """Only trajectories on this subject (e.g. ``belayer.trajectories.<rollout_id>.*``);
    empty: every trajectory."""
    ack_wait_s: float = 30.0
    """JetStream redelivers a held trajectory not acked or marked in progress this long; the
    trainer marks every held one in progress every third of it."""
    step_attempts: int = 3
    """Tries of one batch's update. A trajectory whose own forward or loss fails is
    dead-lettered at once (with the rest of its group; the other groups train in a later
    step); a failure no single trajectory explains is retried, and once the same batch failed
    this often — counted in the step's plan, so a trainer that died on it counts too — the
    whole batch is dead-lettered and training goes on."""
    hold_before_checkpoint_s: float = 0.0
    """Failure-injection window: wait this long between a step's update and its checkpoint
    (so a kill lands mid-step); 0 in normal runs."""
    hold_after_checkpoint_s: float = 0.0
    """Failure-injection window: wait this long after a step's checkpoint is durable (its
    ``trainer_checkpointed``), before its push, its acks and its ``train_step`` (so a kill
    lands after the checkpoint and before the event); 0 in normal runs."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and gradient clipping."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """The GRPO objective."""

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.groups_per_step < 1:
            raise ValueError("group_size and groups_per_step must be >= 1")
        if self.max_staleness < 0 or self.max_steps < 0:
            raise ValueError("max_staleness and max_steps must be >= 0")
        if min(self.checkpoint_every, self.keep_checkpoints, self.threads, self.step_attempts) < 1:
            raise ValueError(
                "checkpoint_every, keep_checkpoints, threads and step_attempts must be >= 1"
            )
        if not 1 <= self.procs <= 64:
            raise ValueError(f"procs must be between 1 and 64, got {self.procs}")
        if not self.logprob_diff_bound > 0 or not self.ack_wait_s > 0:
            raise ValueError("logprob_diff_bound and ack_wait_s must be > 0")
        if min(self.temperature, self.hold_before_checkpoint_s, self.hold_after_checkpoint_s) < 0:
            raise ValueError(
                "temperature, hold_before_checkpoint_s and hold_after_checkpoint_s must be >= 0"
            )

    def resolved_device(self) -> str:
        """``cpu`` or ``cuda`` for ``device`` (imports torch for ``auto``/``cuda``);
        ``FatalError`` (one line) where this trainer cannot run on it."""
        try:
            device = resolve_device(self.device)
        except ValueError as exc:
            raise FatalError(str(exc)) from None
        if device == "cuda" and (self.procs > 1 or self.deterministic):
            raise FatalError(
                "the trainer on cuda runs as one process without the deterministic forward "
                f"(got procs={self.procs}, deterministic={self.deterministic}); use --device cpu"
            )
        return device

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step
