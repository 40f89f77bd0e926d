"""Settings of the training step in :mod:`model.training` (AdamW, clipping, warm-up, seed).

They live here, not in ``model/``, because service configs nest them (the trainer's; the
supervisor forwards it) and the supervisor and the CLI read those configs without loading
torch, which importing anything of ``model/`` does."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimConfig:
    """How the weights are updated (AdamW) and what makes an update reproducible."""

    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay of AdamW."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm of each optimiser step to this (0: no clipping)."""
    warmup_steps: int = 0
    """Optimiser steps of linear learning-rate warm-up from 0 to ``lr``."""
    decay_steps: int = 0
    """Optimiser steps over which the learning rate then falls from ``lr`` to 0 along a cosine
    (0: constant after the warm-up). ``belayer run`` sets it to the run's steps."""
    seed: int = 0
    """Seed of every random number generator the training step uses (torch, numpy, random)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"AdamW betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if min(self.max_grad_norm, self.warmup_steps, self.decay_steps, self.weight_decay) < 0:
            raise ValueError(
                "max_grad_norm, warmup_steps, decay_steps and weight_decay must be >= 0"
            )
