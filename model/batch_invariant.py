"""Batch-invariant building blocks of the deterministic forward (``deterministic=True``).

In deterministic mode the value computed for a token at position ``p`` of a sequence is a
function of that sequence's tokens ``0..p`` only: not of the batch it runs in, its place in the
batch, its neighbours, whether its past K/V came from a prefill or from decode steps, or whether
it runs in the engine (paged) or in the trainer (dense). Every op of the forward is either
row-wise with a fixed per-row shape, or one of the primitives below, each measured to be
row-invariant with this repository's torch/MKL on CPU with one intra-op thread
(``tests/unit/test_batch_invariant.py`` checks every claim on the machine it runs on):

- :func:`linear`: the CPU sgemm gives each output row the same bits for any number of rows
  ``M >= MIN_GEMM_ROWS`` (16), in any position and order; fewer rows use other kernels with
  other reduction orders (on AVX2 machines ``M = 1..3``; on AVX-512 ones every ``M`` up to 15,
  measured for K from 64 to 8192). So a matmul with fewer rows is padded with zero rows up to
  ``MIN_GEMM_ROWS``. With two or more threads the rows are split and a thread's share can fall
  below the minimum, so the deterministic forward runs on one thread (:func:`one_thread`).
- :func:`silu`: ``F.silu`` finishes a tensor whose size is not a multiple of the vector width
  with a scalar loop whose ``exp`` differs from the vectorised one in the last bit, so a row's
  result would depend on the tensor's total size; ``x / (1 + exp(-x))`` uses ops that are
  row-invariant (``exp`` is the same on both paths here, division is IEEE-exact).
- :func:`attend`: attention of each query row over its own sequence's keys in fixed chunks of
  ``ATTENTION_CHUNK`` positions, in position order, with an online softmax. Every reduction
  (``amax``, ``sum`` over one chunk, the ``q·k`` and ``p·v`` products as batched matmuls with at
  least ``MIN_GEMM_ROWS`` rows) has a fixed length and order per row; keys past a query's position are masked
  to ``-inf`` and contribute exact zeros, and chunks wholly past it leave the running state
  bitwise unchanged (``exp(0) == 1``). A query therefore gets the same bits whether it is one
  of a 1000-token prefill, a decode step in a batch of 8 with longer neighbours, or a row of a
  padded training batch.

RMSNorm (``F.rms_norm``), ``log_softmax``, ``softmax``, ``amax``, ``cumsum``, ``sort`` and
element-wise arithmetic are row-invariant as they are (measured likewise). On GPU the same
switch maps to SGLang's ``--enable-deterministic-inference`` (batch-invariant kernels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

MIN_GEMM_ROWS = 16
"""Fewest rows a deterministic matmul runs with (smaller ones are zero-padded): the largest
threshold measured (AVX-512 sgemm; AVX2 needs 4)."""
ATTENTION_CHUNK = 128
"""Key positions per step of the deterministic attention's online softmax. Part of the
numerics: the engine and the trainer must use the same value."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch intra-op thread (a no-op when already so)."""
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pad_rows(x: Tensor, dim: int) -> tuple[Tensor, int]:
    """``x`` with zeros appended along ``dim`` up to ``MIN_GEMM_ROWS``; and its original size."""
    n = x.shape[dim]
    if n >= MIN_GEMM_ROWS:
        return x, n
    shape = list(x.shape)
    shape[dim] = MIN_GEMM_ROWS - n
    return torch.cat([x, x.new_zeros(shape)], dim=dim), n


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x, weight)`` (no bias) whose rows do not depend on the other rows of ``x``."""
    lead = x.shape[:-1]
    rows, n = pad_rows(x.reshape(-1, x.shape[-1]).contiguous(), 0)
    return F.linear(rows, weight)[:n].reshape(*lead, weight.shape[0])


def silu(x: Tensor) -> Tensor:
    """Row-invariant SiLU, ``x * sigmoid(x)`` as ``x / (1 + exp(-x))``. The clamp keeps
    ``exp`` finite (below ``x = -80`` the result is ``-0`` either way), so gradients stay finite.
    """
    return x / (1.0 + torch.exp(-x.clamp(min=-80.0)))


def chunks_for(length: int) -> int:
    """Attention chunks that cover ``length`` key positions."""
    return -(-length // ATTENTION_CHUNK)


def chunk_kv(kv: Tensor, num_seqs: int) -> Tensor:
    """``[2, S * L, kvh, hd]`` keys/values, position-major per sequence (``L`` a whole number of
    chunks), as ``[2, chunks, S, kvh, ATTENTION_CHUNK, hd]``, each chunk contiguous."""
    two, total, kvh, hd = kv.shape
    length = total // num_seqs
    c = ATTENTION_CHUNK
    view = kv.reshape(two, num_seqs, length // c, c, kvh, hd)
    return view.permute(0, 2, 1, 4, 3, 5).contiguous()


def attend(q: Tensor, q_pos: Tensor, kv: Tensor) -> Tensor:
    """Causal attention of query rows over their own sequence's chunked keys.

    ``q`` is ``[S, kvh, M, hd]``: for each of ``S`` sequences and each KV head, ``M`` query
    rows (the query heads of that KV head, for one or more tokens); ``q_pos`` ``[S, M]`` is each
    row's position (it sees keys at positions ``<= q_pos``); ``kv`` is :func:`chunk_kv`'s
    ``[2, chunks, S, kvh, C, hd]``. Returns ``[S, kvh, M, hd]``. Keys past a row's position
    may hold anything finite.
    """
    s, kvh, m, hd = q.shape
    qp, _ = pad_rows(q, 2)
    pos, _ = pad_rows(q_pos, 1)  # padded rows see key 0 only; their output is dropped
    rows = qp.shape[2]
    qf = qp.reshape(s * kvh, rows, hd)
    scale = hd**-0.5
    c = kv.shape[4]
    key_pos = torch.arange(c)
    mx = denom = acc = qf  # bound in the first iteration
    for i in range(kv.shape[1]):
        k = kv[0, i].view(s * kvh, c, hd)
        v = kv[1, i].view(s * kvh, c, hd)
        scores = torch.matmul(qf, k.transpose(1, 2)) * scale
        visible = (key_pos + i * c)[None, None, :] <= pos[:, :, None]  # [S, rows, C]
        scores = scores.view(s, kvh, rows, c).masked_fill(~visible[:, None], float("-inf"))
        scores = scores.view(s * kvh, rows, c)
        if i == 0:  # chunk 0 always holds position 0, so every row has a finite maximum
            mx = scores.amax(dim=-1)
            p = torch.exp(scores - mx[..., None])
            denom = p.sum(dim=-1)
            acc = torch.matmul(p, v)
        else:
            new = torch.maximum(mx, scores.amax(dim=-1))
            alpha = torch.exp(mx - new)
            p = torch.exp(scores - new[..., None])
            denom = denom * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v)
            mx = new
    out = acc / denom[..., None]
    return out.view(s, kvh, rows, hd)[:, :, :m]
