"""The generic training step and its checkpoint: shared by the GRPO trainer and the supervised
warm start (no bus, no services: a loss callback decides what is being learnt).

- :class:`OptimConfig` (in :mod:`common.training_config`, importable without torch): AdamW hyper-parameters, gradient clipping, warm-up, the seed.
- :func:`make_optimizer` / :func:`make_scheduler`: AdamW (the plain for-loop implementation,
  deterministic on CPU) and a linear warm-up then constant learning rate.
- :func:`train_step`: one *update* over a batch already split into mini-batches of
  micro-batches: per mini-batch, zero the gradients, ``loss_fn(micro).backward()`` for every
  micro-batch (gradient accumulation: the callback scales its loss), clip the global gradient
  norm, one optimiser and scheduler step. With one intra-op thread and fixed seeds the result
  is bitwise reproducible: the same starting state and batches give ``torch.equal`` weights.
- :func:`save_checkpoint` / :func:`load_checkpoint`: model (safetensors), optimiser, scheduler
  and RNG state (``torch.save``) and a JSON ``meta`` of the caller's, written atomically: into a
  temporary directory, each file flushed to disk, then one ``rename`` — a reader sees the whole
  checkpoint or none of it.
- :func:`publishable_state_dict`: the weights under the names the weight store keeps (a tied
  ``lm_head.weight`` left out), ready for ``push_weights``; :func:`weights_sha256`: their
  digest in a canonical order (what a run reports per step).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from common.training_config import OptimConfig

__all__ = [
    "OptimConfig",
    "StepStats",
    "load_checkpoint",
    "make_optimizer",
    "make_scheduler",
    "publishable_state_dict",
    "save_checkpoint",
    "seed_everything",
    "train_step",
    "weights_sha256",
]

M = TypeVar("M")

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
META_FILE = "meta.json"


@dataclass(frozen=True)
class StepStats:
    """What one :func:`train_step` did."""

    loss: float
    """Sum of the micro-batch losses (as the callback scaled them) over all mini-batches."""
    grad_norm: float
    """Global gradient norm before clipping, of the last optimiser step."""
    lr: float
    """Learning rate the last optimiser step used (read before the scheduler moves on: after
    it, the rate is the next step's — 0 at the end of a cosine that this step did not use)."""
    optimizer_steps: int
    """Optimiser steps taken (one per mini-batch)."""
    micro_batches: int
    """Forward/backward passes run."""
    seconds: float
    """Wall time of the whole step."""


def seed_everything(seed: int) -> None:
    """Seed torch, numpy and ``random``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters with ``requires_grad``, each once (tied weights appear once)."""
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; the for-loop implementation (``foreach=False``),
    whose per-parameter arithmetic does not depend on how parameters are grouped."""
    return torch.optim.AdamW(
        trainable_parameters(model),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
        fused=False,
    )


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps`` optimiser steps, then the constant ``lr`` — or,
    with ``decay_steps``, a cosine from ``lr`` to 0 over that many steps after the warm-up
    (the factor of optimiser step ``s`` depends on ``s`` alone: a resumed scheduler, its
    ``last_epoch`` restored, goes on exactly)."""
    warmup, decay = cfg.warmup_steps, cfg.decay_steps

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if decay <= 0:
            return 1.0
        done = min(1.0, (step - warmup) / decay)
        return 0.5 * (1.0 + math.cos(math.pi * done))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    minibatches: Sequence[Sequence[M]],
    loss_fn: Callable[[M], Tensor],
    *,
    max_grad_norm: float,
) -> StepStats:
    """One update: an optimiser step per mini-batch, accumulating the gradients of its
    micro-batches (``loss_fn`` returns each micro-batch's share of the mini-batch loss)."""
    if not minibatches or any(not mb for mb in minibatches):
        raise ValueError("train_step needs at least one non-empty mini-batch")
    t0 = time.perf_counter()
    params = trainable_parameters(model)
    model.train()
    total, grad_norm, lr, steps, micro = 0.0, 0.0, 0.0, 0, 0
    for minibatch in minibatches:
        optimizer.zero_grad(set_to_none=True)
        for item in minibatch:
            total += backward_micro(loss_fn(item), micro)
            micro += 1
        norm = _clip(params, max_grad_norm)
        grad_norm = float(norm)
        if not torch.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}")
        lr = float(optimizer.param_groups[0]["lr"])  # the rate this optimiser step uses
        optimizer.step()
        scheduler.step()
        steps += 1
    return StepStats(
        loss=total,
        grad_norm=grad_norm,
        lr=lr,
        optimizer_steps=steps,
        micro_batches=micro,
        seconds=time.perf_counter() - t0,
    )


def backward_micro(loss: Tensor, micro: int) -> float:
    """Backpropagate micro-batch ``micro``'s loss (gradients accumulate); its value.
    ``FloatingPointError`` naming the micro-batch for a non-finite loss, before any backward."""
    if not bool(torch.isfinite(loss)):
        raise FloatingPointError(f"non-finite loss {float(loss.detach())} in micro-batch {micro}")
    loss.backward()
    return float(loss.detach())


def _clip(params: list[nn.Parameter], max_norm: float) -> Tensor:
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(with_grad, max_norm, foreach=False)
    norms = torch.stack([p.grad.detach().norm(2) for p in with_grad if p.grad is not None])
    return norms.norm(2)


def publishable_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``name → tensor`` as the weight store and safetensors keep them: detached, contiguous,
    and a tied ``lm_head.weight`` (the embedding itself) left out."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        out[name] = t.detach().contiguous()
    return out


def weights_sha256(tensors: Mapping[str, Tensor]) -> str:
    """The sha256 of ``tensors`` (``name → tensor``, e.g. :func:`publishable_state_dict`) in a
    canonical order: names sorted; for each, a JSON header ``[name, dtype, shape]`` and the
    raw bytes of the tensor, contiguous on the CPU. Equal digests: bitwise-equal weights,
    whatever order a model keeps its tensors in."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        digest.update(json.dumps([name, dtype, list(t.shape)]).encode() + b"\n")
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --- checkpoints ------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG the training step may draw from."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "random": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])


def save_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    meta: dict[str, Any],
) -> Path:
    """Write a checkpoint directory at ``path`` atomically and return it.

    ``model.safetensors`` (the publishable weights), ``train_state.pt`` (optimiser, scheduler,
    RNG) and ``meta.json`` (``meta``, JSON-serialisable) go into ``<path>.tmp-<pid>``, each
    fsynced; the directory is renamed to ``path`` (replacing an older one of that name) and the
    parent directory fsynced. A crash leaves either the old state or the new one, plus at worst
    a ``.tmp-*`` directory that the next save of that name removes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(publishable_state_dict(model), str(tmp / MODEL_FILE))
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
        },
        tmp / STATE_FILE,
    )
    (tmp / META_FILE).write_text(json.dumps(meta, sort_keys=True))
    for name in (MODEL_FILE, STATE_FILE, META_FILE):
        _fsync(tmp / name)
    _fsync(tmp)
    old = path.with_name(f"{path.name}.old-{os.getpid()}")
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    return path


def read_meta(path: Path) -> dict[str, Any]:
    """The ``meta`` a checkpoint was saved with."""
    meta: dict[str, Any] = json.loads((Path(path) / META_FILE).read_text())
    return meta


def load_weights(path: Path) -> dict[str, Tensor]:
    """A checkpoint's weights (publishable names)."""
    return load_file(str(Path(path) / MODEL_FILE), device="cpu")


def load_checkpoint(
    path: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load the optimiser and scheduler state (and the RNG state) of a checkpoint into the
    given objects — built over a model made from :func:`load_weights` — and return its meta."""
    state = torch.load(Path(path) / STATE_FILE, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        set_rng_state(state["rng"])
    return read_meta(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (1: the reproducible setting)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
