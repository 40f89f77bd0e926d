"""One GRPO update on the trainer's own copy of the weights, and the trainer's checkpoint:
pure (torch and ``model/``; no bus, no event loop), so a test runs the very update the service
runs and compares the weights bit for bit.

``grpo_step(state, samples, …)``:

1. advantages of the batch (:func:`~services.trainer.core.group_advantages`);
2. the batch shuffled by a generator seeded with ``(seed, step)`` (independent of any global
   RNG) and split into ``minibatches`` optimiser steps of micro-batches of at most
   ``micro_batch_size`` rows, each micro-batch one sampling temperature;
3. **training–inference agreement**: before any weight moves, the log-probability of every
   model token under the weights that generated it — the state's model for tokens of its own
   version, ``generating(version)`` for older ones — through the training forward
   (:func:`~model.train_forward.token_logprobs`), compared with what the rollout engine
   reported: ``logprob_diff_max`` / ``logprob_diff_mean`` over the model tokens. These
   recomputed values are the behaviour policy's ``old_logp`` of the ratio (TRL's
   ``old_per_token_logps``); tokens whose weights are not available fall back to the rollout
   log-probability and are counted in ``unchecked_tokens``;
4. with ``beta > 0`` the reference model's log-probabilities;
5. :func:`model.training.train_step` with :func:`~services.trainer.core.grpo_loss` as the
   loss callback (``dapo`` normalised by the mini-batch's model tokens, the others divided by
   its micro-batches — TRL's gradient accumulation);
6. ``step + 1``, ``version + 1``, the batch's ids appended to ``trained``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict, Unpack

import torch
from torch import Tensor

from model.config import ModelConfig
from model.qwen3 import Qwen3ForCausalLM, build_model
from model.train_forward import build_trainable_model, token_logprobs
from model.training import (
    OptimConfig,
    StepStats,
    load_checkpoint,
    load_weights,
    make_optimizer,
    make_scheduler,
    publishable_state_dict,
    save_checkpoint,
    train_step,
)
from schemas.events_training import UpdateMetrics
from services.trainer.config import GrpoConfig
from services.trainer.core import (
    Sample,
    check_grouped,
    clip_fractions,
    group_advantages,
    grpo_loss,
    k3,
)

Generating = Callable[[int], Qwen3ForCausalLM | None]
"""Weights of an older version (inference mode), or None when they are gone."""


class StepOptions(TypedDict):
    """The keyword arguments of every GRPO update (:func:`grpo_step`, ``dp.dp_grpo_step``,
    ``ranks.Ranks.grpo_step``), declared once."""

    group_size: int
    grpo: GrpoConfig
    optim: OptimConfig
    pad_id: int
    generating: NotRequired[Generating | None]


@dataclass
class TrainState:
    """Everything one update changes, and what a checkpoint holds."""

    model: Qwen3ForCausalLM
    """The trainable copy of the weights."""
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int
    """Updates done."""
    version: int
    """Weight version the model's weights are (published, or to be published, as)."""
    trained: list[str] = field(default_factory=list)
    """Every trajectory id trained on, in order."""
    ref_model: Qwen3ForCausalLM | None = None
    """The frozen reference policy (only with ``beta > 0``)."""


@dataclass
class _Micro:
    rows: list[int]
    input_ids: Tensor
    attention_mask: Tensor
    mask: Tensor
    """[b, T-1] float: 1 where position t predicts a model token."""
    rollout_logp: Tensor
    versions: Tensor
    """[b, T-1] int64: weight version of the token position t predicts (-1 elsewhere)."""
    advantages: Tensor
    temperature: float
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None


def new_state(
    cfg: ModelConfig,
    tensors: dict[str, Tensor],
    version: int,
    optim: OptimConfig,
    *,
    deterministic: bool = False,
    with_reference: bool = False,
    device: str = "cpu",
) -> TrainState:
    """A fresh state over copies of ``tensors`` (weight version ``version``) on ``device``
    (``cpu``, or ``cuda``: the model, its optimizer state and each micro-batch live there)."""
    model = build_trainable_model(cfg, tensors, deterministic=deterministic, device=device)
    opt = make_optimizer(model, optim)
    ref = reference_model(cfg, tensors, deterministic, device) if with_reference else None
    return TrainState(
        model, opt, make_scheduler(opt, optim), step=0, version=version, ref_model=ref
    )


def reference_model(
    cfg: ModelConfig, tensors: dict[str, Tensor], deterministic: bool, device: str = "cpu"
) -> Qwen3ForCausalLM:
    owned = {k: v.detach().to(device, copy=True) for k, v in tensors.items()}
    return build_model(cfg, owned, deterministic=deterministic)


def collate(samples: Sequence[Sample], rows: list[int], adv: Tensor, pad_id: int) -> _Micro:
    """Right-padded ``[b, T]`` tensors of prompt + response, and the per-position masks."""
    seqs = [list(samples[i].prompt_ids) + list(samples[i].response_ids) for i in rows]
    t = max(len(s) for s in seqs)
    b = len(rows)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t - 1))
    logp = torch.zeros((b, t - 1))
    versions = torch.full((b, t - 1), -1, dtype=torch.long)
    for j, i in enumerate(rows):
        s, seq = samples[i], seqs[j]
        ids[j, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[j, : len(seq)] = 1
        p, r = len(s.prompt_ids), len(s.response_ids)
        if r:
            # response token k sits at input position p + k and is predicted at output p + k - 1
            mask[j, p - 1 : p - 1 + r] = torch.tensor(s.loss_mask, dtype=torch.float32)
            logp[j, p - 1 : p - 1 + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
            versions[j, p - 1 : p - 1 + r] = torch.tensor(s.weight_versions, dtype=torch.long)
    versions = versions.masked_fill(mask == 0, -1)
    temps = {_scored_temperature(samples[i].temperature) for i in rows}
    if len(temps) != 1:
        raise ValueError(f"one micro-batch mixes temperatures {sorted(temps)}")
    return _Micro(rows, ids, attn, mask, logp, versions, adv[rows], temps.pop())


def _to_model(m: _Micro, model: Qwen3ForCausalLM) -> _Micro:
    """``m``'s tensors on ``model``'s device (the same object on the CPU)."""
    dev = model.model.embed_tokens.weight.device
    if m.input_ids.device == dev:
        return m
    return _Micro(
        m.rows, m.input_ids.to(dev), m.attention_mask.to(dev), m.mask.to(dev),
        m.rollout_logp.to(dev), m.versions.to(dev), m.advantages.to(dev), m.temperature,
    )  # fmt: skip


def _scored_temperature(t: float) -> float:
    """Greedy rollouts report log-probabilities at temperature 1 (the engine's sampler)."""
    return 1.0 if t <= 0 else t


def plan_micro_batches(
    samples: Sequence[Sample], step: int, grpo: GrpoConfig, seed: int
) -> list[list[list[int]]]:
    """Row indices: mini-batches (optimiser steps) of micro-batches. The order is a shuffle
    seeded by ``(seed, step)``; a micro-batch holds one temperature."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    order = torch.randperm(len(samples), generator=gen).tolist()
    n_mini = min(grpo.minibatches, len(samples))
    minis = [order[i::n_mini] for i in range(n_mini)]
    out: list[list[list[int]]] = []
    for mini in minis:
        by_temp: dict[float, list[int]] = {}
        for i in mini:
            by_temp.setdefault(_scored_temperature(samples[i].temperature), []).append(i)
        micros: list[list[int]] = []
        for rows in by_temp.values():
            micros += [
                rows[k : k + grpo.micro_batch_size]
                for k in range(0, len(rows), grpo.micro_batch_size)
            ]
        out.append(micros)
    return out


@torch.no_grad()
def recompute(
    state: TrainState, micro: _Micro, generating: Generating | None
) -> tuple[Tensor, Tensor]:
    """``old_logp`` of ``micro`` under each token's generating weights, and a bool mask of the
    model tokens actually recomputed (the rest keep the rollout log-probability)."""
    old = micro.rollout_logp.clone()
    checked = torch.zeros_like(micro.mask, dtype=torch.bool)
    for v in sorted({int(x) for x in micro.versions.unique().tolist() if x >= 0}):
        model = state.model if v == state.version else (generating(v) if generating else None)
        if model is None:
            continue
        on = _to_model(micro, model)  # an older version's model may live on another device
        lp = token_logprobs(model, on.input_ids, on.attention_mask, micro.temperature)
        sel = micro.versions == v
        old = torch.where(sel, lp.float().to(old.device), old)
        checked |= sel
    return old, checked


def _behaviour_logprobs(
    state: TrainState,
    samples: Sequence[Sample],
    plan: list[list[list[int]]],
    adv: Tensor,
    grpo: GrpoConfig,
    pad_id: int,
    generating: Generating | None,
) -> tuple[list[list[_Micro]], Tensor, int]:
    """Collate every micro-batch of ``plan`` and give it its behaviour (old) log-probabilities
    (and the reference's when ``beta != 0``); also |old - rollout| per compared token and the
    count of tokens that could not be compared."""
    state.model.eval()
    minis: list[list[_Micro]] = []
    diffs: list[Tensor] = []
    unchecked = 0
    for mini in plan:
        micros = [_to_model(collate(samples, rows, adv, pad_id), state.model) for rows in mini]
        for m in micros:
            m.old_logp, checked = recompute(state, m, generating)
            real = m.mask.bool()
            diffs.append((m.old_logp - m.rollout_logp).abs()[real & checked])
            unchecked += int((real & ~checked).sum())
            if grpo.beta != 0.0:
                if state.ref_model is None:
                    raise ValueError("beta != 0 needs a reference model in the train state")
                with torch.no_grad():
                    m.ref_logp = token_logprobs(
                        state.ref_model, m.input_ids, m.attention_mask, m.temperature
                    ).float()
        minis.append(micros)
    return minis, (torch.cat(diffs) if diffs else torch.zeros(0)), unchecked


class _Loss:
    """The loss of one micro-batch (``train_step``'s ``loss_fn``), recording its clip
    fractions and KL as it goes."""

    def __init__(
        self, state: TrainState, grpo: GrpoConfig, max_len: int, minis: list[list[_Micro]]
    ) -> None:
        self.state, self.grpo, self.max_len = state, grpo, max_len
        self.tokens_in = {id(mb): float(sum(m.mask.sum() for m in mb)) for mb in minis}
        self.clip_stats: list[tuple[float, float, float]] = []
        self.kls: list[float] = []

    def __call__(self, item: tuple[_Micro, list[_Micro]]) -> Tensor:
        m, mini = item
        grpo = self.grpo
        assert m.old_logp is not None
        logp = token_logprobs(self.state.model, m.input_ids, m.attention_mask, m.temperature)
        loss = grpo_loss(
            logp,
            m.old_logp,
            m.advantages,
            m.mask,
            loss_type=grpo.loss_type,
            eps_low=grpo.eps_low,
            eps_high=grpo.eps_high,
            beta=grpo.beta,
            ref_logp=m.ref_logp,
            max_completion_length=self.max_len,
            importance_sampling_level=grpo.importance_sampling_level,
            num_items_in_batch=self.tokens_in[id(mini)],
        )
        lo, hi = clip_fractions(
            logp.detach(), m.old_logp, m.advantages, m.mask,
            eps_low=grpo.eps_low, eps_high=grpo.eps_high,
        )  # fmt: skip
        self.clip_stats.append((lo, hi, float(m.mask.sum())))
        if m.ref_logp is not None:
            d = (m.ref_logp - logp.detach()) * m.mask
            kl = (k3(d) * m.mask).sum() / m.mask.sum().clamp(min=1)
            self.kls.append(float(kl))
        return loss if grpo.loss_type == "dapo" else loss / len(mini)


@dataclass
class _Batch:
    """What an update (single process or data-parallel) derives from its samples first."""

    rewards: Tensor
    scored: Tensor
    """Per sample: its reward counts in the step's statistics (failed rewards do not)."""
    adv: Tensor
    plan: list[list[list[int]]]
    max_len: int

    def reward_stats(self) -> tuple[float, float]:
        """Mean and standard deviation of the scored rewards (0, 0 without any)."""
        if not bool(self.scored.any()):
            return 0.0, 0.0
        scored = self.rewards[self.scored]
        return float(scored.mean()), float(scored.std(correction=0))


def _batch(state: TrainState, samples: Sequence[Sample], options: StepOptions) -> _Batch:
    """Check the grouping; the advantages, the plan of micro-batches and the length bound."""
    grpo, group_size = options["grpo"], options["group_size"]
    check_grouped(samples, group_size)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    valid = [not s.reward_failed for s in samples]
    adv = group_advantages(rewards, group_size, scale=grpo.scale_rewards, valid=valid)
    plan = plan_micro_batches(samples, state.step, grpo, options["optim"].seed)
    max_len = grpo.max_completion_length or max(len(s.response_ids) for s in samples)
    return _Batch(rewards, torch.tensor(valid), adv, plan, max_len)


def grpo_step(
    state: TrainState, samples: Sequence[Sample], **options: Unpack[StepOptions]
) -> UpdateMetrics:
    """One GRPO update of ``state`` on ``samples`` (whole groups, contiguous); see the module
    doc. Mutates ``state``; returns the step's measurements (the first fields of its
    ``TrainStep`` event)."""
    grpo, generating = options["grpo"], options.get("generating")
    b = _batch(state, samples, options)
    t0 = time.perf_counter()
    minis, all_diffs, unchecked = _behaviour_logprobs(
        state, samples, b.plan, b.adv, grpo, options["pad_id"], generating
    )
    recompute_s = time.perf_counter() - t0
    loss_fn = _Loss(state, grpo, b.max_len, minis)
    stats: StepStats = train_step(
        state.model,
        state.optimizer,
        state.scheduler,
        [[(m, mb) for m in mb] for mb in minis],
        loss_fn,
        max_grad_norm=options["optim"].max_grad_norm,
    )
    state.model.eval()
    state.step += 1
    state.version += 1
    state.trained += [s.trajectory_id for s in samples]
    clip_stats, kls = loss_fn.clip_stats, loss_fn.kls
    weight = sum(c[2] for c in clip_stats) or 1.0
    reward_mean, reward_std = b.reward_stats()
    return UpdateMetrics(
        step=state.step,
        version=state.version,
        loss=stats.loss / max(1, stats.optimizer_steps),
        reward_mean=reward_mean,
        reward_std=reward_std,
        samples=len(samples),
        groups=len(samples) // options["group_size"],
        tokens=sum(s.model_tokens for s in samples),
        logprob_diff_max=float(all_diffs.max()) if all_diffs.numel() else 0.0,
        logprob_diff_mean=float(all_diffs.mean()) if all_diffs.numel() else 0.0,
        unchecked_tokens=unchecked,
        logprob_tokens_compared=int(all_diffs.numel()),
        trajectory_ids=[s.trajectory_id for s in samples],
        clip_low=sum(c[0] * c[2] for c in clip_stats) / weight,
        clip_high=sum(c[1] * c[2] for c in clip_stats) / weight,
        kl=sum(kls) / len(kls) if kls else 0.0,
        grad_norm=stats.grad_norm,
        lr=stats.lr,
        recompute_s=recompute_s,
        train_s=stats.seconds,
    )


@torch.no_grad()
def find_poison(
    state: TrainState,
    samples: Sequence[Sample],
    *,
    group_size: int,
    grpo: GrpoConfig,
    pad_id: int,
    generating: Generating | None = None,
) -> dict[str, str]:
    """After a failed :func:`grpo_step`: the trajectories that fail the update on their own.
    Each sample alone goes through what the step does with it — collation, the behaviour
    log-probabilities, the training forward and its loss with its group's advantage — under
    ``no_grad`` (nothing changes in ``state``); trajectory id → what went wrong (an exception,
    or a non-finite log-probability or loss). Empty: no single trajectory explains it."""
    state.model.eval()
    try:
        rewards = [s.reward for s in samples]
        valid = [not s.reward_failed for s in samples]
        adv = group_advantages(rewards, group_size, scale=grpo.scale_rewards, valid=valid)
    except ValueError:
        adv = torch.zeros(len(samples))
    out: dict[str, str] = {}
    for i, s in enumerate(samples):
        try:
            m = _to_model(collate(samples, [i], adv, pad_id), state.model)
            old, _ = recompute(state, m, generating)
            logp = token_logprobs(state.model, m.input_ids, m.attention_mask, m.temperature)
            loss = grpo_loss(
                logp, old, m.advantages, m.mask, loss_type=grpo.loss_type,
                eps_low=grpo.eps_low, eps_high=grpo.eps_high,
                importance_sampling_level=grpo.importance_sampling_level,
            )  # fmt: skip
            real = m.mask.bool()
            if not bool(torch.isfinite(old[real]).all() and torch.isfinite(logp[real]).all()):
                out[s.trajectory_id] = "non-finite log-probability on its model tokens"
            elif not bool(torch.isfinite(loss)):
                out[s.trajectory_id] = f"non-finite loss {float(loss)}"
        except Exception as exc:  # whatever it raises is what the step raised on it
            out[s.trajectory_id] = f"{type(exc).__name__}: {exc}"[:500]
    return out


# --- checkpoints ------------------------------------------------------------------------------
REFERENCE_FILE = "reference.safetensors"


def save_state(path: Path, state: TrainState, meta: dict[str, Any]) -> Path:
    """Checkpoint ``state`` at ``path`` atomically (``model.training.save_checkpoint``); its
    meta holds ``step``, ``version`` and ``trained`` besides ``meta``."""
    full = {**meta, "step": state.step, "version": state.version, "trained": state.trained}
    return save_checkpoint(path, state.model, state.optimizer, state.scheduler, full)


def load_state(
    path: Path,
    cfg: ModelConfig,
    optim: OptimConfig,
    *,
    deterministic: bool = False,
    reference: dict[str, Tensor] | None = None,
    device: str = "cpu",
) -> tuple[TrainState, dict[str, Any]]:
    """The state a checkpoint holds (RNG state restored too), and its meta; on ``device``."""
    tensors = load_weights(path)
    state = new_state(cfg, tensors, 0, optim, deterministic=deterministic, device=device)
    meta = load_checkpoint(path, state.optimizer, state.scheduler)
    state.step, state.version = int(meta["step"]), int(meta["version"])
    state.trained = list(meta["trained"])
    if reference is not None:
        state.ref_model = reference_model(cfg, reference, deterministic, device)
    return state, meta


def load_weights_file(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def save_reference(path: Path, state: TrainState) -> None:
    """The starting weights (the KL reference), written atomically."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(publishable_state_dict(state.model), str(tmp))
    os.replace(tmp, path)


def weights_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Same names and bitwise-equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
