"""Batch-invariant building blocks of the deterministic forward (``deterministic=True``).

In deterministic mode the value computed for a token at position ``p`` of a sequence is a
function of that sequence's tokens ``0..p`` only: not of the batch it runs in, its place in the
batch, its neighbours, whether its past K/V came from a prefill or from decode steps, or whether
it runs in the engine (paged) or in the trainer (dense). Every op of the forward is either
row-wise with a fixed per-row shape, or one of the primitives below, each measured to be
row-invariant with this repository's torch/MKL on CPU with one intra-op thread
(``tests/unit/test_batch_invariant.py`` checks every claim on the machine it runs on):

- :func:`linear`: the CPU sgemm gives each output row the same bits for any number of rows
  ``M >= MIN_GEMM_ROWS`` (16), in any position and order; fewer rows may use other kernels
  with other reduction orders (on AVX2 machines ``M = 1..3``; on AVX-512 ones every ``M`` up to
  15, measured for K from 64 to 8192). So a matmul with fewer rows is padded with zero rows up
  a bucket of :data:`ROW_BUCKETS` no smaller than :func:`min_rows`, the fewest rows from which,
  for that product's shape on this machine, the buckets up to ``MIN_GEMM_ROWS`` give the bits
  of ``MIN_GEMM_ROWS`` rows (probed once per shape and process; 16 where nothing smaller holds).
  Padding to fewer rows therefore changes no bit, only the cost: where the floor is 4 (the
  AMD EPYC the engine was first measured on) a decode step of batch 1 pads to 4 rows and one
  of batch 8 not at all; where it is 16 (an AVX-512 Intel Xeon) every step below 16 rows runs
  16 (``belayer bench engine --vs-hf`` records which, ``det_step_rows``). The engine's
  prepared products (MKL-packed, :mod:`model.fused`) give those bits from fewer rows on the
  machines measured (1 on that Xeon: :func:`model.fused.exact_floor`), so there a deterministic
  engine's step pads its rows to their floor instead. With two or more
  threads the rows are split and a thread's share can fall below the minimum, so the
  deterministic forward runs on one thread (:func:`one_thread`).
- :func:`silu`: ``F.silu`` finishes a tensor whose size is not a multiple of the vector width
  with a scalar loop whose ``exp`` differs from the vectorised one in the last bit, so a row's
  result would depend on the tensor's total size; ``x / (1 + exp(-x))`` uses ops that are
  row-invariant (``exp`` is the same on both paths here, division is IEEE-exact).
- :func:`attend`: attention of each query row over its own sequence's keys in fixed chunks of
  ``ATTENTION_CHUNK`` positions, in position order, with an online softmax. Every reduction
  (``amax``, ``sum`` over one chunk, the ``q·k`` and ``p·v`` products as batched matmuls with at
  least :func:`min_rows` rows) has a fixed length and order per row; keys past a query's position
  are left out of the maximum and contribute exact zeros to the sums (as if their scores were
  ``-inf``), and chunks wholly past it leave the running state
  bitwise unchanged (``exp(0) == 1``). A query therefore gets the same bits whether it is one
  of a 1000-token prefill, a decode step in a batch of 8 with longer neighbours, or a row of a
  padded training batch.

RMSNorm (``F.rms_norm``), ``log_softmax``, ``softmax``, ``amax``, ``cumsum``, ``sort`` and
element-wise arithmetic are row-invariant as they are (measured likewise). On GPU the same
switch maps to SGLang's ``--enable-deterministic-inference`` (batch-invariant kernels).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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


ROW_BUCKETS = (1, 2, 4, 8, MIN_GEMM_ROWS)
"""Row counts a deterministic product below ``MIN_GEMM_ROWS`` rows is padded to (the smallest
one that holds its rows and is at least :func:`min_rows`)."""

_MIN_ROWS: dict[tuple[str, int, int, torch.dtype], int] = {}


def min_rows(kind: str, k: int, n: int, dtype: torch.dtype = torch.float32) -> int:
    """Fewest rows (one of ``ROW_BUCKETS``) a deterministic product of this shape is padded to.

    ``kind`` is ``linear`` (``F.linear(x [M, k], w [n, k])``), ``qk`` (``matmul(q [b, M, k],
    key [b, n, k].transpose)``) or ``pv`` (``matmul(p [b, M, k], v [b, k, n])``), the three
    products of the deterministic forward, in ``dtype``. Probed once per shape, dtype and
    process: the smallest
    bucket from which every bucket up to ``MIN_GEMM_ROWS`` gives each row (at the start and at
    the end of the rows) the bits it gets among ``MIN_GEMM_ROWS`` rows. Padding to any bucket
    from there on gives the same bits as padding to ``MIN_GEMM_ROWS``, so the engine and the
    trainer agree whichever each pads to.
    """
    key = (kind, k, n, dtype)
    found = _MIN_ROWS.get(key)
    if found is None:
        found = _MIN_ROWS[key] = _probe_min_rows(kind, k, n, dtype)
    return found


def padded_rows(kind: str, k: int, n: int, m: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows ``m`` rows of a ``kind`` product are padded to (``m`` itself from ``MIN_GEMM_ROWS``)."""
    return bucket(m, min_rows(kind, k, n, dtype))


def bucket(m: int, floor: int, any_count: bool = False) -> int:
    """``m`` rows padded for products whose :func:`min_rows` is at most ``floor``;
    ``any_count``: products exact for every count of rows from ``floor`` up, not only
    ``ROW_BUCKETS``' (:attr:`model.fused.Projection.any_count`), so padded up to ``floor`` only."""
    if m >= MIN_GEMM_ROWS or (any_count and m >= floor):
        return m
    return next(b for b in ROW_BUCKETS if b >= m and b >= floor)


def _product(
    kind: str, k: int, n: int, dtype: torch.dtype, gen: torch.Generator
) -> Callable[[Tensor], Tensor]:
    """``kind``'s product of ``[M, k]`` rows with a random operand, laid out as the model does.
    The operand repeats a random block along ``n`` (its values do not choose the kernel)."""
    block = torch.randn(min(n, 1024), k, generator=gen).to(dtype)
    other = block.repeat(-(-n // block.shape[0]), 1)[:n].contiguous()
    if kind == "linear":
        return lambda rows: F.linear(rows, other)
    if kind == "qk":
        keys = other[None]
        return lambda rows: torch.matmul(rows[None], keys.transpose(1, 2))[0]
    if kind == "pv":
        values = other.t().contiguous()[None]
        return lambda rows: torch.matmul(rows[None], values)[0]
    raise ValueError(f"unknown product kind {kind!r}")


def _probe_min_rows(kind: str, k: int, n: int, dtype: torch.dtype) -> int:
    gen = torch.Generator().manual_seed(1_000_003 * k + n)
    with torch.inference_mode(), one_thread():
        product = _product(kind, k, n, dtype, gen)
        x = torch.randn(MIN_GEMM_ROWS, k, generator=gen).to(dtype)
        ref = product(x)
        floor = MIN_GEMM_ROWS
        for m in reversed(ROW_BUCKETS[:-1]):
            head = product(x[:m].clone())
            tail = product(x[MIN_GEMM_ROWS - m :].clone())
            if not (torch.equal(head, ref[:m]) and torch.equal(tail, ref[MIN_GEMM_ROWS - m :])):
                break
            floor = m
        return floor


def pad_rows(x: Tensor, dim: int, rows: int = MIN_GEMM_ROWS) -> tuple[Tensor, int]:
    """``x`` with zeros appended along ``dim`` up to ``rows``; and its original size."""
    n = x.shape[dim]
    if n >= rows:
        return x, n
    pad = [0, 0] * (x.dim() - dim % x.dim())  # F.pad counts from the last dim
    pad[-1] = rows - n
    return F.pad(x, pad), n


def linear(
    x: Tensor,
    weight: Tensor,
    product: Callable[[Tensor], Tensor] | None = None,
    floor: int | None = None,
    any_count: bool = False,
) -> Tensor:
    """``F.linear(x, weight)`` (no bias) whose rows do not depend on the other rows of ``x``.

    ``product``: computes ``F.linear(rows, weight)`` with its bits from ``floor`` rows up
    (default :func:`min_rows`; the engine's prepared :class:`model.fused.Projection` and its
    ``exact_rows``), in every count of rows from there where ``any_count`` (:func:`bucket`);
    ``F.linear`` itself by default.
    """
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    n_out, k = weight.shape
    run = product if product is not None else functools.partial(F.linear, weight=weight)
    if flat.shape[0] >= MIN_GEMM_ROWS:
        return run(flat).reshape(*lead, n_out)
    m = flat.shape[0]
    if floor is None:
        floor = min_rows("linear", k, n_out, weight.dtype)
    rows, n = pad_rows(flat.contiguous(), 0, bucket(m, floor, any_count))
    out = run(rows)
    return (out if rows.shape[0] == n else out[:n]).reshape(*lead, n_out)


def silu(x: Tensor) -> Tensor:
    """Row-invariant SiLU, ``x * sigmoid(x)`` as ``x / (1 + exp(-x))``. The clamp keeps
    ``exp`` finite (below ``x = -80`` the result is ``-0`` either way), so gradients stay finite.
    """
    if x.requires_grad and torch.is_grad_enabled():
        return x / (1.0 + torch.exp(-x.clamp(min=-80.0)))
    # The engine: the same operations on one buffer (t + 1 is 1 + t, bit for bit).
    return x / x.clamp(min=-80.0).neg_().exp_().add_(1.0)


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


def gather_index(slots: Tensor, kv_heads: int, num_slots: int) -> Tensor:
    """Rows of a layer's cache viewed as ``[2 * num_slots * kv_heads, hd]`` that
    :func:`chunk_kv` of ``cache[:, slots.reshape(-1)]`` would hold, in its order: one
    ``index_select`` then gives :func:`chunk_kv`'s layout without the permuting copy.
    ``slots`` is ``[S, L]`` (``L`` a whole number of chunks)."""
    s, length = slots.shape
    c = ATTENTION_CHUNK
    per_chunk = slots.view(s, length // c, c).transpose(0, 1)  # [chunks, S, C]
    heads = torch.arange(kv_heads, device=slots.device)[None, None, :, None]
    rows = (per_chunk[:, :, None, :] * kv_heads + heads).reshape(-1)
    return torch.cat([rows, rows + num_slots * kv_heads])


def attend(q: Tensor, q_pos: Tensor, kv: Tensor, cache: dict[str, Any] | None = None) -> Tensor:
    """Causal attention of query rows over their own sequence's chunked keys.

    ``q`` is ``[S, kvh, M, hd]``: for each of ``S`` sequences and each KV head, ``M`` query
    rows (the query heads of that KV head, for one or more tokens); ``q_pos`` ``[S, M]`` is each
    row's position (it sees keys at positions ``<= q_pos``); ``kv`` is :func:`chunk_kv`'s
    ``[2, chunks, S, kvh, C, hd]``. Returns ``[S, kvh, M, hd]``. Keys past a row's position
    may hold anything finite. ``cache``: a dict kept for calls with the same ``q_pos`` and
    chunk count (the layers of one step), where the masks are built once.

    A chunk past every row's last visible key is read only up to the next multiple of
    ``TRIM_STEP`` positions where :func:`trims_exactly` says that gives the whole chunk's bits
    on this machine (a decode step's last chunk is mostly empty).
    """
    s, kvh, m, hd = q.shape
    chunks = kv.shape[1]
    key = f"attend-{m}-{chunks}"
    plan = None if cache is None else cache.get(key)
    if plan is None:
        plan = _AttendPlan.build(q_pos, s * kvh, (m, hd, kv.shape[4], chunks), q.dtype, q.is_cpu)
        if cache is not None:
            cache[key] = plan
    qp, _ = pad_rows(q, 2, plan.need)
    rows = qp.shape[2]
    if plan.stacked is not None and not (q.requires_grad and torch.is_grad_enabled()):
        return _attend_stacked(qp, kv, plan.stacked)[:, :, :m]
    qf = qp.reshape(s * kvh, rows, hd)
    scale = hd**-0.5
    mx = denom = acc = qf  # bound in the first iteration
    for i, (w, bias, keep) in enumerate(zip(plan.widths, plan.bias, plan.keep, strict=True)):
        if w <= 0:  # past every row: it would leave the state as it is, bit for bit
            continue
        k = kv[0, i].view(s * kvh, -1, hd)[:, :w]
        v = kv[1, i].view(s * kvh, -1, hd)[:, :w]
        raw = torch.matmul(qf, k.transpose(1, 2)).mul_(scale).view(s, kvh, rows, w)
        # + -inf, not masked_fill: the same maximum, and masked_fill with a broadcast mask
        # takes 15x as long (38 against 2.4 us for a decode step's [8, 2, 8, 128] scores).
        top = (raw + bias).amax(dim=-1).view(s * kvh, rows)
        if i == 0:  # chunk 0 always holds position 0, so every row has a finite maximum
            mx = top
            p = _exp_visible(raw, mx, keep)
            denom = p.sum(dim=-1)
            acc = torch.matmul(p, v)
        else:
            new = torch.maximum(mx, top)
            alpha = torch.exp(mx - new)
            p = _exp_visible(raw, new, keep)
            denom = denom * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v)
            mx = new
    out = acc / denom[..., None]
    return out.view(s, kvh, rows, hd)[:, :, :m]


def _attend_stacked(qp: Tensor, kv: Tensor, masks: tuple[Tensor, Tensor]) -> Tensor:
    """:func:`attend`'s loop over the first ``n`` chunks (``masks``' ``[n, S, 1, rows, C]``
    bias and keep) with every chunk's products, maximum, ``exp`` and sum in one call each: the
    chunks are a batch dimension of the same ``[rows, hd] x [hd, C]`` and ``[rows, C] x [C, hd]``
    products, the running maximum is ``cummax`` over them (exact), and only the rescaling of
    the sums and outputs runs chunk by chunk, in the loop's order. Each op is row-wise with the
    loop's per-row shapes, so the bits are the loop's (``tests/unit/test_batch_invariant.py``)
    for a fraction of its calls: ~1.7x faster over 8 chunks (a 1,000-token context) on the EPYC.
    Reads the last chunk whole (the loop may trim it: the same bits where it does)."""
    s, kvh, rows, hd = qp.shape
    bias, keep = masks
    n, c, b = bias.shape[0], kv.shape[4], s * kvh
    qf = qp.reshape(1, b, rows, hd).expand(n, b, rows, hd).reshape(n * b, rows, hd)
    k = kv[0, :n].view(n * b, c, hd)
    raw = torch.bmm(qf, k.transpose(1, 2)).mul_(hd**-0.5).view(n, s, kvh, rows, c)
    top = (raw + bias).amax(dim=-1)  # [n, S, kvh, rows]: each chunk's maximum
    run = top.cummax(dim=0).values  # the loop's running maximum after each chunk
    p = raw.sub_(run[..., None]).mul_(keep).exp_().mul_(keep).view(n * b, rows, c)
    sums = p.sum(dim=-1).view(n, b, rows)
    outs = torch.bmm(p, kv[1, :n].view(n * b, c, hd)).view(n, b, rows, hd)
    run = run.view(n, b, rows)
    denom, acc = sums[0], outs[0]
    for i in range(1, n):
        alpha = torch.exp(run[i - 1] - run[i])
        denom = denom * alpha + sums[i]
        acc = acc * alpha[..., None] + outs[i]
    return (acc / denom[..., None]).view(s, kvh, rows, hd)


@dataclass(frozen=True)
class _AttendPlan:
    """What the :func:`attend` calls of one step share: the rows the products are padded to,
    each chunk's width read and its key masks, ``[S, 1, rows, width]`` (:func:`_masks`); and
    where a decode step reads two or more chunks, their whole masks stacked,
    ``[n, S, 1, rows, C]``, for :func:`_attend_stacked`."""

    need: int
    widths: tuple[int, ...]
    bias: tuple[Tensor, ...]
    keep: tuple[Tensor, ...]
    stacked: tuple[Tensor, Tensor] | None = None

    @classmethod
    def build(
        cls, q_pos: Tensor, b: int, dims: tuple[int, int, int, int], dtype: torch.dtype, cpu: bool
    ) -> _AttendPlan:
        m, hd, c, chunks = dims
        need = max(padded_rows("qk", hd, c, m, dtype), padded_rows("pv", c, hd, m, dtype))
        rows = max(m, need)
        bias, keep = _masks(q_pos, need, chunks, c, dtype)
        widths = [c] * chunks
        if rows <= TRIM_MAX_ROWS and cpu and trims_exactly(b, rows, hd, c, dtype):
            last = int(q_pos.max())
            widths = [
                min(c, -(-(last + 1 - i * c) // TRIM_STEP) * TRIM_STEP) for i in range(chunks)
            ]
        cut = [max(w, 0) for w in widths]
        read = sum(w > 0 for w in widths)  # a prefix: widths do not grow along the chunks
        stacked = None
        if rows <= TRIM_MAX_ROWS and read >= 2:
            stacked = (bias[:read].contiguous(), keep[:read].contiguous())
        return cls(
            need,
            tuple(widths),
            tuple(bias[i, ..., :w].contiguous() for i, w in enumerate(cut)),
            tuple(keep[i, ..., :w].contiguous() for i, w in enumerate(cut)),
            stacked,
        )


TRIM_STEP = 32
"""Key positions a chunk is trimmed in (:func:`attend`)."""
TRIM_MAX_ROWS = 64
"""Most query rows per KV head a trimmed :func:`attend` call has (decode steps and their draft
rows; a prefill or training sequence reads whole chunks: the bits are the same, and the probe
would cost more than it saves)."""
_TRIMS: dict[tuple[int, int, int, int, torch.dtype], bool] = {}


def trims_exactly(b: int, rows: int, hd: int, c: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`attend`'s three reductions over a chunk's keys — the ``q·k`` product
    ``[b, rows, hd] @ [b, hd, w]``, the ``p·v`` product ``[b, rows, w] @ [b, w, hd]`` and the sum
    of ``p`` — give, over the first ``w`` keys, the bits they give over all ``c`` when the rest
    contribute exact zeros, for every multiple ``w`` of ``TRIM_STEP`` below ``c`` (probed once
    per shape and process, on this machine's kernels: measured true on an AVX-512 Xeon; where it
    is false every chunk is read whole)."""
    key = (b, rows, hd, c, dtype)
    found = _TRIMS.get(key)
    if found is None:
        found = _TRIMS[key] = _probe_trim(b, rows, hd, c, dtype)
    return found


def _probe_trim(b: int, rows: int, hd: int, c: int, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(1_000_033 * rows + 7 * b + hd)
    with torch.inference_mode(), one_thread():
        q, k, v = (torch.randn(b, n, hd, generator=gen).to(dtype) for n in (rows, c, c))
        p = torch.rand(b, rows, c, generator=gen).to(dtype)
        whole = torch.matmul(q, k.transpose(1, 2))
        for w in range(TRIM_STEP, c, TRIM_STEP):
            short = p[..., :w].contiguous()
            padded = F.pad(short, (0, c - w))
            if not torch.equal(torch.matmul(q, k[:, :w].transpose(1, 2)), whole[..., :w]):
                return False
            if not torch.equal(torch.matmul(short, v[:, :w]), torch.matmul(padded, v)):
                return False
            if not torch.equal(short.sum(dim=-1), padded.sum(dim=-1)):
                return False
    return True


def _exp_visible(scores: Tensor, top: Tensor, keep: Tensor) -> Tensor:
    """``exp(scores - top)`` ``[S * kvh, rows, C]`` where ``keep`` (``[S, 1, rows, C]``, 0/1)
    is 1, and exactly 0 where it is 0: the hidden keys' differences are zeroed before ``exp``
    and their results after. Masking their scores to ``-inf`` gives the same bits, forward and
    backward (``tests/unit/test_batch_invariant.py``), but ``exp`` of ``-inf`` takes a slow
    path: about 6x the time of finite arguments (15 against 2.4 us for a decode step's
    ``[16, 4, 128]`` scores with 45 % hidden, AVX-512 Xeon, 2026-12-06)."""
    s, kvh, rows, c = scores.shape
    diff = scores - top.view(s, kvh, rows, 1)
    if scores.requires_grad and torch.is_grad_enabled():
        return (torch.exp(diff * keep) * keep).view(s * kvh, rows, c)
    # The engine: the same operations in place, on the difference's own buffer.
    return diff.mul_(keep).exp_().mul_(keep).view(s * kvh, rows, c)


def _masks(
    q_pos: Tensor, need: int, chunks: int, c: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """:func:`attend`'s key masks, ``[chunks, S, 1, rows, C]`` in ``dtype``: ``-inf`` where a
    key is past the row's position and 0 elsewhere (padded rows see key 0 only; their output is
    dropped), and 0/1 for hidden/visible."""
    pos, _ = pad_rows(q_pos, 1, need)
    key_pos = torch.arange(chunks * c, device=q_pos.device).view(chunks, 1, 1, 1, c)
    hidden = key_pos > pos[None, :, None, :, None]
    bias = torch.zeros(hidden.shape, dtype=dtype, device=q_pos.device)
    return bias.masked_fill_(hidden, float("-inf")), (~hidden).to(dtype)
