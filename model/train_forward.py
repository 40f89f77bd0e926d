"""The training-side forward of :class:`~model.qwen3.Qwen3ForCausalLM`: dense, differentiable.

The inference engine runs the model over a paged KV cache under ``torch.inference_mode()``.
A trainer (GRPO) instead needs, for a padded ``[B, T]`` batch of whole sequences, every
position's logits with autograd on. This module provides that on the *same* module and
parameter names (``forward_dense`` of each layer in :mod:`model.qwen3`), so the state dict a
trainer produces loads unchanged into :func:`~model.qwen3.build_model` for serving.

Public helpers:

- :func:`build_trainable_model` ``(cfg, tensors, deterministic=False)``: the model over owned
  copies of ``tensors``, with ``requires_grad`` on and in train mode (optimiser steps never
  write into the weight store's shared memory). ``model.state_dict()`` is what to publish back.
- :func:`dense_forward` ``(model, input_ids, attention_mask=None)``: logits ``[B, T, V]`` in
  the model's dtype, differentiable.
- :func:`token_logprobs` ``(model, input_ids, attention_mask=None, temperature=1.0)``:
  ``[B, T-1]`` fp32 log-probability of each next token, ``log_softmax(logits / temperature)``
  gathered at ``input_ids[:, 1:]``; entries whose context or target is padding are 0.
- :func:`attention_positions` and :func:`attention_mask_4d`: the per-row positions and the
  ``[B, 1, T, T]`` causal-and-padding mask the dense forward uses.

Padding: ``attention_mask`` is ``[B, T]``, 1 (true) on real tokens, 0 on padding; each row's
real tokens must be contiguous (left or right padding both work). Positions count real tokens
only, so a row's logits do not depend on how much padding surrounds it. Logits at padded
positions are finite but meaningless. The log-probabilities match what the engine's sampler
reports: ``temperature=1`` for greedy requests, the request's temperature otherwise (the
sampler's logprob is taken before top-p truncation).

True on-policy: a model built with ``deterministic=True`` runs the batch-invariant forward of
:mod:`model.batch_invariant` (the engine's, with ``EngineConfig.deterministic``), so
:func:`token_logprobs` of a trajectory are *bitwise* equal to the log-probabilities the engine
reported while generating it, whatever the padding or the other rows of the batch; in the
default mode they agree to within float rounding (about 1e-6).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.config import ModelConfig
from model.qwen3 import Qwen3ForCausalLM, build_model, logprobs_at_temperature


def build_trainable_model(
    cfg: ModelConfig,
    tensors: dict[str, Tensor],
    *,
    deterministic: bool = False,
    device: str = "cpu",
) -> Qwen3ForCausalLM:
    """The model over owned copies of ``tensors`` (HF names), trainable and in train mode.

    Same validation as :func:`~model.qwen3.build_model` (``ValueError`` on a missing,
    unexpected or misshapen tensor); tied embeddings stay tied. ``deterministic``: the
    batch-invariant forward, bitwise equal to a deterministic engine's. ``device``: where the
    copies live (``cpu``, or ``cuda`` for a trainer on a GPU).
    """
    if device == "cpu":
        owned = {name: t.detach().clone() for name, t in tensors.items()}
    else:
        owned = {name: t.detach().to(device, copy=True) for name, t in tensors.items()}
    model = build_model(cfg, owned, deterministic=deterministic)
    model.requires_grad_(True)
    return model.train()


def attention_positions(attention_mask: Tensor) -> Tensor:
    """``[B, T]`` int64 positions: each real token's index among its row's real tokens.

    Left padding gets position 0, right padding repeats the last real position; both are only
    used for padded (meaningless) outputs.
    """
    valid = attention_mask.to(torch.long)
    return (valid.cumsum(dim=1) - 1).clamp(min=0)


def attention_mask_4d(attention_mask: Tensor) -> Tensor:
    """``[B, 1, T, T]`` bool: query ``q`` sees key ``k`` when ``k <= q`` and ``k`` is real.

    Every query also sees itself, so a padded query (which may have no real key before it)
    still gets a finite softmax; its output is ignored.
    """
    valid = attention_mask.to(torch.bool)
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    mask = (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=valid.device)
    return mask[:, None]


def dense_hidden(
    model: Qwen3ForCausalLM, input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """Final-norm hidden states ``[B, T, hidden]`` of a ``[B, T]`` batch (see the module doc)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    if attention_mask is None:
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        spans = [(0, t)] * b if model.deterministic else None
        return model.forward_dense(input_ids, positions, None, spans)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != "
            f"input_ids shape {tuple(input_ids.shape)}"
        )
    positions = attention_positions(attention_mask)
    if model.deterministic:
        return model.forward_dense(input_ids, positions, None, real_spans(attention_mask))
    return model.forward_dense(input_ids, positions, attention_mask_4d(attention_mask))


def real_spans(attention_mask: Tensor) -> list[tuple[int, int]]:
    """Each row's ``(start, length)`` of real tokens; ``ValueError`` if they are not contiguous."""
    valid = attention_mask.to(torch.bool)
    lengths = valid.sum(dim=1).tolist()
    starts = valid.to(torch.int8).argmax(dim=1).tolist()
    for i, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        if not bool(valid[i, start : start + n].all()):
            raise ValueError(f"row {i} of attention_mask: real tokens are not contiguous")
    return list(zip(starts, lengths, strict=True))


def dense_forward(
    model: Qwen3ForCausalLM, input_ids: Tensor, attention_mask: Tensor | None = None
) -> Tensor:
    """Logits ``[B, T, vocab]`` (model dtype) for every position of a ``[B, T]`` batch."""
    return model.compute_logits(dense_hidden(model, input_ids, attention_mask))


def token_logprobs(
    model: Qwen3ForCausalLM,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """``[B, T-1]`` fp32 ``log p(input_ids[:, t+1] | input_ids[:, :t+1])``, differentiable.

    Computed as the engine's sampler does (:func:`~model.qwen3.logprobs_at_temperature`).
    Entries where position ``t`` or ``t+1`` is padding are 0, so ``sum`` over a row is the
    log-likelihood of its real continuation.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (greedy: use 1.0)")
    hidden = dense_hidden(model, input_ids, attention_mask)[:, :-1]
    logits = model.compute_logits(hidden)
    temps = None  # 1.0: no division (the same bits)
    if temperature != 1.0:
        temps = torch.full(logits.shape[:-1], temperature, device=logits.device)
    logprobs = logprobs_at_temperature(logits, temps)
    chosen = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    if attention_mask is None:
        return chosen
    valid = attention_mask.to(torch.bool)
    return chosen.masked_fill(~(valid[:, :-1] & valid[:, 1:]), 0.0)
