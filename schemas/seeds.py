"""Sampling seeds: the counter-based hash behind seeded sampling, and per-sample seeds.

A seeded request's j-th token depends only on ``(seed, j, logits)`` (the worker's sampler hashes
``(seed, j)`` with :func:`splitmix64`). The ``n`` samples of one task (a GRPO group) must
therefore *not* share a seed — identical samples would zero the group's advantages — so each
gets :func:`derive_seed` ``(seed, sample_index)``: distinct per index, stable across runs,
processes and machines (pure integer arithmetic).
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
"""Seeds and counters are hashed as unsigned 64-bit integers."""


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser of ``x + golden gamma`` (a bijection on 64-bit integers)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` (0, 1, …) of a task seeded ``seed``.

    A signed 64-bit integer (what ``SamplingParams.seed`` holds), a pure function of its
    arguments, distinct for distinct indices of one seed (``splitmix64`` is a bijection and its
    input, ``splitmix64(seed) + odd * (index + 1)`` modulo 2**64, differs for every index).
    Raises ``ValueError`` for a negative index.
    """
    if sample_index < 0:
        raise ValueError(f"sample_index must be >= 0, got {sample_index}")
    z = splitmix64((splitmix64(seed & MASK64) + 0xD1B54A32D192ED03 * (sample_index + 1)) & MASK64)
    return z - (1 << 64) if z >= 1 << 63 else z
