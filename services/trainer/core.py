"""The trainer's decisions, pure (torch, no bus, no event loop): GRPO advantages and loss, and
which trajectories make up a training batch.

**Advantages and loss follow Hugging Face TRL's ``GRPOTrainer``** (matched against
``trl/trainer/grpo_trainer.py``, ``_generate_and_score_completions`` and ``_compute_loss``, as
of July 2026), so runs can be compared:

- :func:`group_advantages`: ``A = (r - mean_group) / (std + 1e-4)``, ``std`` with Bessel's
  correction; ``scale="group"``: the std of the sample's group, ``"batch"``: the std of the
  whole batch (the mean stays the group's, as in TRL), ``"none"``: no division. A group of
  one sample has std 0 (TRL: ``num_generations == 1``), so its advantage is 0.
- :func:`grpo_loss`: ratio ``exp(logp - old_logp)`` per token (``importance_sampling_level=
  "token"``) or ``exp`` of the masked mean log-ratio per sequence (``"sequence"``, GSPO);
  per-token loss ``-min(ratio·A, clip(ratio, 1-eps_low, 1+eps_high)·A)``, plus
  ``beta · k3`` with ``k3 = exp(ref - logp) - (ref - logp) - 1`` when ``beta != 0``; then
  aggregated over the masked (model) tokens as TRL's ``loss_type`` does:
  ``grpo``: mean over each sequence's tokens, then over sequences; ``bnpo``: sum / masked
  tokens of this call; ``dr_grpo``: sum / (batch · ``max_completion_length``); ``dapo``: sum /
  ``num_items_in_batch``, the masked tokens of the global batch (default: of this call).

Differences from TRL, all deliberate: defaults ``eps_high=0.28`` (TRL: ``epsilon_high``
defaults to ``epsilon``; 0.28 is the DAPO paper's value, TRL's docs recommend it); ``dr_grpo``
with ``max_completion_length=None`` uses the token dimension of the call (TRL requires the
configured constant); the gradient-accumulation division TRL applies to ``grpo``/``bnpo``/
``dr_grpo`` (and ``num_items_in_batch`` for ``dapo``) is the caller's: the trainer divides by
the micro-batches of each optimiser step and passes the step's token count — identical to TRL
with ``steps_per_generation == gradient_accumulation_steps`` (its default). TRL's other loss
types (``cispo``, ``sapo``, …), ``delta`` and the vLLM importance-sampling correction are not
implemented.

**Batches.** Trajectories arrive one by one; :class:`Batcher` keeps them by group (task) until
``groups_per_step`` groups of ``group_size`` samples are complete, refuses duplicates (by
trajectory id, and a second sample for the same group slot) and samples staler than
``max_staleness`` versions (default 0: on-policy), and holds samples from a version the
trainer has not reached yet. A batch is ordered by rollout, slot and sample index, never by
arrival (a killed worker or controller changes which trajectory finishes first, and the order
of the batch decides its micro-batches and the order of every float reduction of the update).

**A failed update** (:func:`after_step_failure`): trajectories whose own forward or loss fails
are dead-lettered with the rest of their groups and the batch's other groups go back to the
batcher; a failure no trajectory explains is retried, and after ``step_attempts`` failures on
the same batch the whole batch is dead-lettered — training never loops on one batch.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingLevel = Literal["token", "sequence"]

STD_EPS = 1e-4
"""Added to the reward std before dividing (TRL's constant)."""


# --- advantages ---------------------------------------------------------------------------------
def group_advantages(
    rewards: Tensor | Sequence[float],
    group_size: int,
    *,
    scale: ScaleRewards = "group",
    valid: Sequence[bool] | None = None,
) -> Tensor:
    """Group-relative advantages of ``rewards`` (``[groups * group_size]``, each group's samples
    contiguous): ``(r - mean_group) / (std + 1e-4)`` with the std of ``scale`` (see the module
    doc). Returns fp32 ``[groups * group_size]``; a constant group gets 0, never NaN.

    ``valid`` (default: all) leaves samples out: a sample whose reward failed gets advantage
    0, and the mean and std it would have entered are those of the valid samples only (so
    with every sample valid the result is TRL's, bit for bit)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.numel() == 0 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    if valid is not None and not all(valid):
        return _masked_advantages(r, group_size, scale, torch.tensor(list(valid)))
    grouped = r.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    advantages = r - mean
    if scale == "none":
        return advantages
    if scale == "group":
        std = (
            grouped.std(dim=1, correction=1, keepdim=True).expand_as(grouped).reshape(-1)
            if group_size > 1
            else torch.zeros_like(r)
        )
    elif scale == "batch":
        std = r.std(correction=1).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
    else:
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    return advantages / (std + STD_EPS)


def _masked_advantages(r: Tensor, group_size: int, scale: ScaleRewards, ok: Tensor) -> Tensor:
    """``group_advantages`` over the ``ok`` samples only; the others get 0."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    out = torch.zeros_like(r)
    kept = r[ok]
    for g in range(r.numel() // group_size):
        idx = torch.arange(g * group_size, (g + 1) * group_size)
        idx = idx[ok[idx]]
        if idx.numel() == 0:
            continue
        vals = r[idx]
        adv = vals - vals.mean()
        if scale == "group":
            std = vals.std(correction=1) if idx.numel() > 1 else torch.zeros(())
        elif scale == "batch":
            std = kept.std(correction=1) if kept.numel() > 1 else torch.zeros(())
        else:
            out[idx] = adv
            continue
        out[idx] = adv / (std + STD_EPS)
    return out


# --- loss ---------------------------------------------------------------------------------------
def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: LossType = "dapo",
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    max_completion_length: int | None = None,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    num_items_in_batch: float | Tensor | None = None,
) -> Tensor:
    """The clipped GRPO surrogate loss (a scalar, differentiable through ``logp``).

    ``logp``, ``old_logp``, ``mask`` (and ``ref_logp``) are ``[batch, tokens]``: the current and
    the behaviour policy's log-probability of each token, and 1 on the tokens the model
    generated (prompt, observation and padding tokens 0). ``advantages`` is ``[batch]`` (or
    ``[batch, tokens]``). See the module doc for the aggregation of each ``loss_type``.
    """
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp and mask must share one [batch, tokens] shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    m = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    if adv.shape[0] != logp.shape[0]:
        raise ValueError(f"advantages for {adv.shape[0]} rows, logp has {logp.shape[0]}")

    log_ratio = logp - old_logp
    if importance_sampling_level == "token":
        log_weights = log_ratio
    elif importance_sampling_level == "sequence":
        log_weights = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(
            f"importance_sampling_level must be token or sequence, got {importance_sampling_level!r}"
        )
    ratio = torch.exp(log_weights)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if beta != 0.0:
        if ref_logp is None or ref_logp.shape != logp.shape:
            raise ValueError("beta != 0 needs ref_logp of logp's shape")
        per_token = per_token + beta * k3(ref_logp - logp)
    per_token = per_token.expand_as(logp) if per_token.shape != logp.shape else per_token

    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = logp.shape[1] if max_completion_length is None else max_completion_length
        if length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {length}")
        return (per_token * m).sum() / (logp.shape[0] * length)
    if loss_type == "dapo":
        items = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
        return (per_token * m).sum() / items.to(logp.dtype).clamp(min=1.0)
    raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, got {loss_type!r}")


def k3(delta: Tensor) -> Tensor:
    """The k3 estimator of KL(policy ‖ reference) per token, ``exp(δ) − δ − 1`` with
    ``δ = ref_logp − logp`` (≥ 0, 0 where the two agree): the loss's KL term and the ``kl``
    a step reports."""
    return torch.exp(delta) - delta - 1


def clip_fractions(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[float, float]:
    """Fractions of masked tokens clipped below (ratio < 1-eps_low with A < 0) and above
    (ratio > 1+eps_high with A > 0), TRL's ``clip_ratio/low_mean`` and ``high_mean``."""
    with torch.no_grad():
        ratio = torch.exp(logp - old_logp)
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        m = mask.to(torch.float32)
        n = float(m.sum().clamp(min=1.0))
        low = ((ratio < 1 - eps_low) & (adv < 0)).float()
        high = ((ratio > 1 + eps_high) & (adv > 0)).float()
        return float((low * m).sum()) / n, float((high * m).sum()) / n


# --- samples and batches -----------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One trajectory as the trainer uses it (decoded from a ``Trajectory`` record)."""

    trajectory_id: str
    """Unique id: the dedup key."""
    group_id: str
    """The GRPO group (one task's ``n`` samples share it)."""
    sample_index: int
    """Slot of the sample in its group, ``0 .. group_size-1``."""
    prompt_ids: tuple[int, ...]
    """Prompt token ids."""
    response_ids: tuple[int, ...]
    """Every token after the prompt: model tokens and observation tokens."""
    loss_mask: tuple[int, ...]
    """Per response token: 1 on model tokens (trained on), 0 on observation tokens."""
    rollout_logprobs: tuple[float, ...]
    """Per response token: the rollout engine's log-probability (model tokens)."""
    weight_versions: tuple[int, ...]
    """Per response token: the weight version that produced it (model tokens)."""
    reward: float
    """The trajectory's reward."""
    reward_failed: bool = False
    """Its reward functions failed (``Trajectory.reward_error``): it gets no advantage and
    its group's mean and std are those of the others."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (0, greedy, is scored at 1)."""
    stream_seq: int = 0
    """Position in the trajectory stream (where it arrived: reported, never an order)."""
    slot: int = 0
    """Slot in its rollout (task ``slot // n``, sample ``slot % n``): orders the groups of a
    batch, so a batch's order never depends on which trajectory finished first."""

    def model_versions(self) -> list[int]:
        return [v for v, m in zip(self.weight_versions, self.loss_mask, strict=True) if m]

    @property
    def oldest_version(self) -> int:
        """The oldest weight version among its model tokens (0 when it has none)."""
        versions = self.model_versions()
        return min(versions) if versions else 0

    @property
    def newest_version(self) -> int:
        versions = self.model_versions()
        return max(versions) if versions else 0

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)


def without_trailing_context(s: Sample) -> Sample:
    """``s`` without the tokens after its last model token (the observation of a trajectory
    that ended on ``length`` or ``max_turns``): they are never trained on and, the forward
    being causal, change no log-probability before them — but they may run past the model's
    context (a response that filled it, then its observation)."""
    end = len(s.loss_mask)
    while end > 0 and s.loss_mask[end - 1] != 1:
        end -= 1
    if end in (0, len(s.loss_mask)) or len(s.response_ids) != len(s.loss_mask):
        return s  # nothing to drop (or malformed: ``validate_sample`` says why)
    return dataclasses.replace(
        s,
        response_ids=s.response_ids[:end],
        loss_mask=s.loss_mask[:end],
        rollout_logprobs=s.rollout_logprobs[:end],
        weight_versions=s.weight_versions[:end],
    )


def validate_sample(s: Sample, max_len: int = 0) -> None:
    """``ValueError`` naming what is inconsistent in ``s`` (a malformed record); with
    ``max_len`` (the model's context) also a sample longer than the model can take."""
    n = len(s.response_ids)
    if not s.prompt_ids:
        raise ValueError("empty prompt")
    if max_len and len(s.prompt_ids) + n > max_len:
        raise ValueError(f"{len(s.prompt_ids) + n} tokens: longer than the model's {max_len}")
    for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
        if len(getattr(s, name)) != n:
            raise ValueError(f"{name} has {len(getattr(s, name))} entries for {n} response tokens")
    if any(m not in (0, 1) for m in s.loss_mask):
        raise ValueError("loss_mask must hold 0 or 1")
    if s.sample_index < 0:
        raise ValueError("sample_index must be >= 0")
    if not all(_finite(x) for x in (s.reward, s.temperature, *s.rollout_logprobs)):
        raise ValueError("reward, temperature and logprobs must be finite")


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


class Verdict(enum.Enum):
    """What :meth:`Batcher.offer` did with a sample."""

    ACCEPTED = "accepted"
    """Held for a batch."""
    TRAINED = "trained"
    """Its id was trained on already (a redelivery): ack, do not train."""
    DUPLICATE = "duplicate"
    """Its id, or its group slot, is already held: the first one counts."""
    STALE = "stale"
    """Older than the staleness bound allows: refused."""
    INVALID = "invalid"
    """Its sample index does not fit the group size."""


@dataclass
class Batcher:
    """Groups samples into training batches (see the module doc). Pure state; the service
    acks and reports what it says."""

    group_size: int
    """Samples per group (``n``)."""
    groups_per_step: int
    """Groups per training batch."""
    max_staleness: int = 0
    """A sample is trainable at version ``v`` when ``v - max_staleness <= oldest_version``."""
    trained: set[str] = field(default_factory=set)
    """Every trajectory id trained on (restored from the checkpoint)."""
    groups: dict[str, dict[int, Sample]] = field(default_factory=dict)
    """Held samples: group id → sample index → sample."""

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.groups_per_step < 1 or self.max_staleness < 0:
            raise ValueError("group_size and groups_per_step must be >= 1, max_staleness >= 0")

    @property
    def held_ids(self) -> set[str]:
        return {s.trajectory_id for g in self.groups.values() for s in g.values()}

    def is_stale(self, sample: Sample, version: int) -> bool:
        """Older than the bound allows (a sample without model tokens never is: it still
        counts in its group's advantages)."""
        return sample.model_tokens > 0 and sample.oldest_version < version - self.max_staleness

    def offer(self, sample: Sample, version: int) -> Verdict:
        """Take ``sample`` for a later batch at trainer version ``version``, or say why not."""
        if sample.trajectory_id in self.trained:
            return Verdict.TRAINED
        if sample.sample_index >= self.group_size:
            return Verdict.INVALID
        if self.is_stale(sample, version):
            return Verdict.STALE
        group = self.groups.setdefault(sample.group_id, {})
        if sample.trajectory_id in self.held_ids or sample.sample_index in group:
            return Verdict.DUPLICATE
        group[sample.sample_index] = sample
        return Verdict.ACCEPTED

    def expire(self, version: int) -> list[Sample]:
        """Drop and return held samples that became stale at ``version`` (their whole group:
        a GRPO group is trained whole or not at all)."""
        out: list[Sample] = []
        for gid in list(self.groups):
            if any(self.is_stale(s, version) for s in self.groups[gid].values()):
                out += sorted(self.groups.pop(gid).values(), key=lambda s: s.sample_index)
        return out

    def ready_groups(self, version: int) -> list[str]:
        """Complete groups trainable at ``version`` (none of their tokens newer than it), in
        slot order: by rollout, then by their first slot (:func:`group_order`) — never by
        arrival, which a failure changes (failure transparency)."""
        done = [
            gid
            for gid, g in self.groups.items()
            if len(g) == self.group_size
            and all(
                s.newest_version <= version and not self.is_stale(s, version) for s in g.values()
            )
        ]
        return sorted(done, key=lambda gid: group_order(gid, self.groups[gid].values()))

    def next_batch(self, version: int) -> list[Sample] | None:
        """The next batch (``groups_per_step`` groups, each in sample order) and take it out of
        the held samples; None until enough groups are complete."""
        ready = self.ready_groups(version)[: self.groups_per_step]
        if len(ready) < self.groups_per_step:
            return None
        return self._take(ready)

    def planned_batch(self, trajectory_ids: Sequence[str]) -> list[Sample] | None:
        """The batch a plan names (exactly these samples, in this order) once all are held;
        None while some are missing."""
        by_id = {s.trajectory_id: (gid, s) for gid, g in self.groups.items() for s in g.values()}
        if not all(t in by_id for t in trajectory_ids):
            return None
        out = []
        for t in trajectory_ids:
            gid, s = by_id[t]
            del self.groups[gid][s.sample_index]
            if not self.groups[gid]:
                del self.groups[gid]
            out.append(s)
        return out

    def _take(self, group_ids: Iterable[str]) -> list[Sample]:
        out: list[Sample] = []
        for gid in group_ids:
            out += [s for _, s in sorted(self.groups.pop(gid).items())]
        return out

    def mark_trained(self, samples: Iterable[Sample]) -> None:
        self.trained.update(s.trajectory_id for s in samples)

    def give_back(self, samples: Iterable[Sample]) -> None:
        """Hold again samples taken for a batch that was not trained (whole groups)."""
        for s in samples:
            self.groups.setdefault(s.group_id, {})[s.sample_index] = s


def group_order(group_id: str, samples: Iterable[Sample]) -> tuple[str, int, str]:
    """Where a group goes in a batch: its rollout (the group id's part before ``/``), its first
    slot, its id. A function of the group's content, so the batch a failure delayed is the
    batch a failure-free run trains, in the same order."""
    return group_id.partition("/")[0], min((s.slot for s in samples), default=0), group_id


# --- a failed update ----------------------------------------------------------------------------
class FailureAction(enum.Enum):
    """What :func:`after_step_failure` decided."""

    RETRY = "retry"
    """Try the same batch again (a one-off failure)."""
    DROP_CULPRITS = "drop_culprits"
    """Dead-letter the trajectories that fail on their own, with their groups; the batch's
    other groups are held again for a later step."""
    DROP_BATCH = "drop_batch"
    """The update failed ``step_attempts`` times on this batch: dead-letter all of it."""


@dataclass(frozen=True)
class StepFailure:
    action: FailureAction
    dead_letter: tuple[tuple[str, str, str], ...] = ()
    """(trajectory id, reason, detail) to send to the dead-letter subject, in batch order;
    reason ``poison`` (it fails the update on its own), ``group_dropped`` (a group mate
    does) or ``step_failed`` (the batch failed ``step_attempts`` times)."""
    keep: tuple[str, ...] = ()
    """Trajectory ids held again (whole groups) for a later batch."""


def after_step_failure(
    batch: Sequence[Sample],
    culprits: dict[str, str],
    *,
    attempts: int,
    max_attempts: int,
    error: str,
) -> StepFailure:
    """Decide after the update on ``batch`` failed ``attempts`` times (the last with
    ``error``). ``culprits``: trajectory id → why it fails the update on its own (empty when
    none does, or when it was not looked for)."""
    poison = {
        s.trajectory_id: culprits[s.trajectory_id] for s in batch if s.trajectory_id in culprits
    }
    if poison:
        by_group: dict[str, list[str]] = {}
        for s in batch:
            if s.trajectory_id in poison:
                by_group.setdefault(s.group_id, []).append(s.trajectory_id)
        dead: list[tuple[str, str, str]] = []
        keep: list[str] = []
        for s in batch:
            tid, bad = s.trajectory_id, by_group.get(s.group_id)
            if tid in poison:
                dead.append((tid, "poison", poison[tid]))
            elif bad:
                dead.append((tid, "group_dropped", f"group mate {bad[0]} fails the update"))
            else:
                keep.append(tid)
        return StepFailure(FailureAction.DROP_CULPRITS, tuple(dead), tuple(keep))
    if attempts < max_attempts:
        return StepFailure(FailureAction.RETRY, keep=tuple(s.trajectory_id for s in batch))
    detail = f"the update failed {attempts} times on this batch: {error}"
    return StepFailure(
        FailureAction.DROP_BATCH, tuple((s.trajectory_id, "step_failed", detail) for s in batch)
    )


def batch_rewards(samples: Sequence[Sample]) -> list[float]:
    return [s.reward for s in samples]


def check_grouped(samples: Sequence[Sample], group_size: int) -> None:
    """``ValueError`` unless ``samples`` are whole groups, contiguous, in slot order."""
    if len(samples) % group_size:
        raise ValueError(f"{len(samples)} samples are not whole groups of {group_size}")
    for i in range(0, len(samples), group_size):
        group = samples[i : i + group_size]
        if len({s.group_id for s in group}) != 1:
            raise ValueError(f"samples {i}..{i + group_size - 1} are not one group")
