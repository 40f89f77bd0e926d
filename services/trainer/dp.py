"""One GRPO update computed data-parallel by the ranks of a ``torch.distributed`` process group
(the trainer's ``--procs``; ``services/trainer/ranks.py`` starts them): pure torch and
``torch.distributed`` collectives, no bus, no event loop.

Every rank holds the same train state and is given the same batch. The plan of micro-batches
is the single process's (:func:`~services.trainer.update.plan_micro_batches`, seeded by the
step); each micro-batch's rows are dealt to the ranks (:func:`share`, row ``i`` of it to rank
``i mod world``), and each rank computes the behaviour log-probabilities, the loss and the
gradients of its rows only. A share's loss is scaled so that the shares of a micro-batch add up
to the micro-batch's loss in the single process (:func:`share_weight`: per loss type, the share
of sequences or of model tokens the whole micro-batch divides by). Per mini-batch the ranks then
sum their gradients (``all_reduce``) and every rank takes the same optimiser step: the summed
gradient is the single process's up to the order of float additions, so the loss equals the
single-process loss within rounding (1e-6), and with one thread per rank and a fixed world size
the reduction order is fixed: the update is bitwise reproducible run to run and every rank ends
with the same weights.

Failures stay collective: a rank whose share fails (an exception, a non-finite loss) still
joins the reduction of the mini-batch, with a flag; when any rank flagged, every rank raises
:class:`StepAborted` before the optimiser step, so all ranks keep the same state and the
trainer treats it as a failed update (retried, or its culprits dead-lettered). A collective that
fails (a rank died) raises out of here: the process group is gone, and the trainer exits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Unpack

import torch
import torch.distributed as dist
from torch import Tensor

from model.train_forward import token_logprobs
from model.training import _clip, backward_micro, trainable_parameters
from schemas.events_training import UpdateMetrics
from services.trainer.config import GrpoConfig
from services.trainer.core import (
    LossType,
    Sample,
    clip_fractions,
    grpo_loss,
    k3,
)
from services.trainer.update import (
    StepOptions,
    TrainState,
    _batch,
    _behaviour_logprobs,
    _Micro,
)


class StepAborted(Exception):
    """A rank's share of the update failed; every rank raises it, before any weight moved
    when it happened in the first mini-batch."""


def share(rows: Sequence[int], rank: int, world: int) -> list[int]:
    """The rows of a micro-batch rank ``rank`` of ``world`` computes: every ``world``-th."""
    return list(rows[rank::world])


def share_weight(
    loss_type: LossType, rows: int, all_rows: int, tokens: float, all_tokens: float
) -> float:
    """The factor turning a share's ``grpo_loss`` (over ``rows`` of the micro-batch's
    ``all_rows`` sequences, ``tokens`` of its ``all_tokens`` model tokens) into its part of the
    micro-batch's loss: ``grpo`` and ``dr_grpo`` divide by sequences, ``bnpo`` by the call's
    model tokens; ``dapo`` divides by the mini-batch's tokens, given to every share alike."""
    if loss_type in ("grpo", "dr_grpo"):
        return rows / all_rows
    if loss_type == "bnpo":
        return tokens / all_tokens if all_tokens > 0 else 0.0
    return 1.0


@dataclass
class _Item:
    micro: _Micro
    """This rank's rows of micro-batch ``index`` (of the whole plan)."""
    index: int
    all_rows: int
    all_tokens: float
    mini_tokens: float
    mini_micros: int


class _ShareLoss:
    """A share's loss (its part of the micro-batch's), recording clip and KL sums."""

    def __init__(self, state: TrainState, grpo: GrpoConfig, max_len: int, micros: int) -> None:
        self.state, self.grpo, self.max_len = state, grpo, max_len
        self.clip = torch.zeros(3, dtype=torch.float64)
        """Sums of clip_low · tokens, clip_high · tokens, tokens."""
        self.kl = torch.zeros(micros, 2, dtype=torch.float64)
        """Per micro-batch of the plan: the k3 sum over its tokens, and its tokens."""

    def __call__(self, it: _Item) -> Tensor:
        m, grpo = it.micro, self.grpo
        assert m.old_logp is not None
        logp = token_logprobs(self.state.model, m.input_ids, m.attention_mask, m.temperature)
        loss = grpo_loss(
            logp, m.old_logp, m.advantages, m.mask, loss_type=grpo.loss_type,
            eps_low=grpo.eps_low, eps_high=grpo.eps_high, beta=grpo.beta, ref_logp=m.ref_logp,
            max_completion_length=self.max_len,
            importance_sampling_level=grpo.importance_sampling_level,
            num_items_in_batch=it.mini_tokens,
        )  # fmt: skip
        tokens = float(m.mask.sum())
        loss = loss * share_weight(grpo.loss_type, len(m.rows), it.all_rows, tokens, it.all_tokens)
        lo, hi = clip_fractions(
            logp.detach(), m.old_logp, m.advantages, m.mask,
            eps_low=grpo.eps_low, eps_high=grpo.eps_high,
        )  # fmt: skip
        self.clip += torch.tensor([lo * tokens, hi * tokens, tokens], dtype=torch.float64)
        if m.ref_logp is not None:
            d = (m.ref_logp - logp.detach()) * m.mask
            self.kl[it.index] += torch.tensor([float((k3(d) * m.mask).sum()), tokens])
        return loss if grpo.loss_type == "dapo" else loss / it.mini_micros


def _items(
    samples: Sequence[Sample],
    plan: list[list[list[int]]],
    mine: list[list[list[int]]],
    micros: list[list[_Micro]],
) -> list[list[_Item]]:
    """This rank's micro-batches per mini-batch (``micros``, collated from its non-empty shares
    ``mine`` of ``plan``), with what each whole micro-batch divides by."""
    tokens = [float(sum(s.loss_mask)) for s in samples]
    out: list[list[_Item]] = []
    index = 0
    for mini, my_mini, my_micros in zip(plan, mine, micros, strict=True):
        mini_tokens = sum(tokens[i] for rows in mini for i in rows)
        queue = iter(my_micros)
        items = []
        for rows, my_rows in zip(mini, my_mini, strict=True):
            if my_rows:
                all_tokens = sum(tokens[i] for i in rows)
                it = _Item(next(queue), index, len(rows), all_tokens, mini_tokens, len(mini))
                items.append(it)
            index += 1
        out.append(items)
    return out


def dp_grpo_step(
    state: TrainState,
    samples: Sequence[Sample],
    *,
    rank: int,
    world: int,
    **options: Unpack[StepOptions],
) -> UpdateMetrics:
    """:func:`~services.trainer.update.grpo_step` computed by ``world`` ranks (the module doc);
    every rank calls it with the same state and batch, in the default process group. Mutates
    ``state`` alike on every rank; the metrics are the whole batch's."""
    grpo, generating = options["grpo"], options.get("generating")
    b = _batch(state, samples, options)
    plan = b.plan
    t0 = time.perf_counter()
    failed: Exception | None = None
    minis: list[list[_Item]] = [[] for _ in plan]
    diffs, unchecked = torch.zeros(0), 0
    mine = [[share(rows, rank, world) for rows in mini] for mini in plan]
    kept = [[rows for rows in mini if rows] for mini in mine]
    try:
        micros, diffs, unchecked = _behaviour_logprobs(
            state, samples, kept, b.adv, grpo, options["pad_id"], generating
        )
        minis = _items(samples, plan, mine, micros)
    except Exception as exc:  # the whole group learns of it in the first reduction
        failed = exc
    recompute_s = time.perf_counter() - t0
    loss_fn = _ShareLoss(state, grpo, b.max_len, sum(len(m) for m in plan))
    t1 = time.perf_counter()
    total, grad_norm, lr = _train(state, minis, loss_fn, options["optim"].max_grad_norm, failed)
    train_s = time.perf_counter() - t1
    state.model.eval()
    state.step += 1
    state.version += 1
    state.trained += [s.trajectory_id for s in samples]
    stats = [float(diffs.double().sum()), float(diffs.numel()), float(unchecked)]
    sums = torch.cat(
        [torch.tensor(stats, dtype=torch.float64), loss_fn.clip, loss_fn.kl.reshape(-1)]
    )
    dist.all_reduce(sums)
    top = torch.tensor([float(diffs.max()) if diffs.numel() else 0.0], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    diff_sum, compared, unchecked_all = (float(x) for x in sums[:3])
    clip = sums[3:6].tolist()
    kl = sums[6:].reshape(-1, 2)
    kl = kl[kl[:, 1] > 0] if grpo.beta != 0.0 else kl[:0]
    weight = clip[2] or 1.0
    reward_mean, reward_std = b.reward_stats()
    return UpdateMetrics(
        step=state.step,
        version=state.version,
        loss=total / max(1, len(plan)),
        reward_mean=reward_mean,
        reward_std=reward_std,
        samples=len(samples),
        groups=len(samples) // options["group_size"],
        tokens=sum(s.model_tokens for s in samples),
        logprob_diff_max=float(top[0]),
        logprob_diff_mean=diff_sum / compared if compared else 0.0,
        unchecked_tokens=int(unchecked_all),
        logprob_tokens_compared=int(compared),
        trajectory_ids=[s.trajectory_id for s in samples],
        clip_low=clip[0] / weight,
        clip_high=clip[1] / weight,
        kl=float((kl[:, 0] / kl[:, 1]).mean()) if len(kl) else 0.0,
        grad_norm=grad_norm,
        lr=lr,
        recompute_s=recompute_s,
        train_s=train_s,
    )


def _train(
    state: TrainState,
    minis: list[list[_Item]],
    loss_fn: _ShareLoss,
    max_grad_norm: float,
    failed: Exception | None,
) -> tuple[float, float, float]:
    """Per mini-batch: this rank's gradients, their sum over the ranks, one optimiser step on
    every rank (``model.training.train_step`` with the reduction between accumulation and
    clipping). Returns the summed loss of all mini-batches, the last gradient norm and the
    learning rate the last optimiser step used."""
    params = trainable_parameters(state.model)
    state.model.train()
    total, grad_norm, lr = 0.0, 0.0, 0.0
    for k, items in enumerate(minis):
        state.optimizer.zero_grad(set_to_none=True)
        local = 0.0
        if failed is None:
            try:
                for it in items:
                    local += backward_micro(loss_fn(it), it.index)
            except Exception as exc:
                failed = exc
        has = [p.grad is not None for p in params]
        flags = torch.tensor(
            [local, float(failed is not None), *map(float, has)], dtype=torch.float64
        )
        dist.all_reduce(flags)
        if flags[1] > 0:
            raise StepAborted(_failure_text(failed, k))
        total += float(flags[0])
        _reduce_gradients(params, [bool(x > 0) for x in flags[2:]])
        norm = _clip(params, max_grad_norm)
        grad_norm = float(norm)
        if not torch.isfinite(norm):
            raise StepAborted(f"non-finite gradient norm {grad_norm}")
        lr = float(state.optimizer.param_groups[0]["lr"])  # the rate this optimiser step uses
        state.optimizer.step()
        state.scheduler.step()
    return total, grad_norm, lr


def _reduce_gradients(params: list[torch.nn.Parameter], used: list[bool]) -> None:
    """Sum each parameter's gradient over the ranks (one flat buffer per dtype); a parameter
    no rank computed a gradient for keeps none (as in the single process)."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p, u in zip(params, used, strict=True):
        if u:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        grads = [p.grad for p in group if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _failure_text(failed: Exception | None, mini: int) -> str:
    """What failed, from every rank (gathered: the trainer logs rank 0's view of all)."""
    mine = f"{type(failed).__name__}: {failed}"[:300] if failed is not None else ""
    texts: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(texts, mine)
    said = [f"rank {r}: {t}" for r, t in enumerate(texts) if t]
    return f"mini-batch {mini}: " + "; ".join(said)
