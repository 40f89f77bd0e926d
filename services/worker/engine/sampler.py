"""Pick the next token of each sequence from its logits.

Greedy when ``temperature == 0``; otherwise temperature scaling, top-p truncation and
inverse-CDF sampling with one uniform number ``u`` per token — the only random draw.

Counter-based determinism: for a request with a ``seed``, ``u`` for its j-th generated token is
a pure hash of ``(seed, j)`` (splitmix64, :func:`seeded_uniform`), where j counts from the start
of the request's whole generation, ``generated_offset`` included; nothing is drawn from a
stateful generator. The token therefore depends only on ``(seed, j, logits)``: a request
resumed on another worker with ``generated_offset=m`` continues with the same draws as an
uninterrupted run, and batching does not change them (every op below is row-wise). With the
engine in deterministic mode the logits are batch-invariant too, so the tokens are. Requests
without a seed draw ``u`` from the sampler's own random stream (the engine gives each request
a seed of its own instead, :meth:`Sampler.new_seed`). The ``n`` samples of one task must get
distinct seeds: :func:`~schemas.seeds.derive_seed` ``(seed, sample_index)``.

Returned logprob: the log-probability of the chosen token under the distribution actually
sampled from *after temperature, before top-p truncation*, i.e.
``log_softmax(logits / temperature)[token]``; for greedy, ``log_softmax(logits)[token]``.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from model.qwen3 import logprobs_at_temperature
from schemas.seeds import MASK64, derive_seed, splitmix64
from services.worker.engine.sequence import SamplingParams

__all__ = ["Sampler", "derive_seed", "seeded_uniform"]


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that depends only on ``(seed, index)``."""
    z = splitmix64(splitmix64(seed & MASK64) ^ (index & MASK64))
    return (z >> 11) * 2.0**-53


class Sampler:
    """Batched greedy / temperature / top-p sampling (see the module docstring)."""

    def __init__(self, seed: int | None = None, vocab: int = 0) -> None:
        """``vocab``: the tokenizer's id range (the model's ``output_vocab_size``), when the
        logits have columns past it (−inf, never drawn); 0: every column is a token."""
        self._rng = random.Random(seed)
        self._vocab = vocab

    def new_seed(self) -> int:
        """A fresh request seed from this sampler's stream (a signed 63-bit integer)."""
        return self._rng.getrandbits(63)

    def __call__(
        self, logits: Tensor, params: list[SamplingParams], sample_indices: list[int]
    ) -> tuple[list[int], list[float]]:
        """Sample one token per row of ``logits`` ``[B, vocab]``.

        ``sample_indices[i]`` is row i's token index j in its request (resume-stable).
        Returns the token ids and their logprobs.
        """
        logits = logits.float()
        scales = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        # None: all 1.0, no division (the same bits). The trainer's token_logprobs computes the
        # same function (bitwise, same logits).
        temps = None if all(t == 1.0 for t in scales) else torch.tensor(scales)
        logprobs = logprobs_at_temperature(logits, temps)
        if all(p.greedy for p in params):
            # The common RL-eval and test path: no sort, no random numbers.
            tokens = self._greedy(logits)
            chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
            return tokens.tolist(), chosen.tolist()
        # The columns past the tokenizer are exact zeros here, last in the sort either way:
        # leaving them out shortens the sort, most of a sampled step's sampling (the tiny math
        # model: 358 of 4096 columns), and draws the same tokens.
        tokens = self._sample(logprobs[:, : self._vocab or None].exp(), params, sample_indices)
        greedy = [p.greedy for p in params]
        if any(greedy):  # a mixed batch only (argmax of 64 rows: 0.45 ms, 40 % of their sort)
            tokens = torch.where(torch.tensor(greedy), self._greedy(logits), tokens)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), chosen.tolist()

    def _greedy(self, logits: Tensor) -> Tensor:
        """Each row's first maximal column (``argmax``'s answer) among the tokenizer's columns
        (the rest are −inf). ``max``'s indices are the first maximum too and come at half
        ``argmax``'s cost (16 rows × 2,042 columns: 32 against 52 µs)."""
        return logits[:, : self._vocab or None].max(dim=-1).indices

    def _sample(
        self, probs: Tensor, params: list[SamplingParams], sample_indices: list[int]
    ) -> Tensor:
        """Inverse-CDF sample from each row's top-p nucleus."""
        # Stable sort so that equal probabilities always order the same way.
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        top_p = torch.tensor([p.top_p for p in params])
        # Keep a token while the mass before it is under top_p: the first always stays.
        outside = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]
        cdf = sorted_p.masked_fill(outside, 0.0).cumsum(dim=-1)
        u = torch.tensor([self._uniform(p, j) for p, j in zip(params, sample_indices, strict=True)])
        target = (u * cdf[:, -1])[:, None]
        pos = torch.searchsorted(cdf, target, right=True)
        # u rounded up to 1.0 in float32 would land past the nucleus: clamp to its last token.
        last_kept = (~outside).sum(dim=-1, keepdim=True) - 1
        pos = torch.minimum(pos, last_kept)
        return order.gather(1, pos).squeeze(1)

    def _uniform(self, params: SamplingParams, index: int) -> float:
        if params.seed is None:
            return self._rng.random()
        return seeded_uniform(params.seed, index)
