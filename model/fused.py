"""The engine's products laid out for speed: fused projections, MKL-packed weights.

A decode step of a small model is a string of small matmuls, and on the CPU each one costs
mostly what it takes to stream its weight through the cache (``docs/architecture.md``, "Engine
speed: where the time goes"). :func:`prepare_for_inference` gives the engine's model, once per
weight version:

- **fused projections**: q, k and v read the same normed input, and so do the MLP's gate and up;
  each group becomes one matrix (``torch.cat`` of the parameters), so one product instead of
  three (two) and one call's overhead;
- **packed weights**: each matrix, where MKL is there, pre-packed once for its GEMM
  (``torch.ops.mkl._mkl_reorder_linear_weight``, which torch's own CPU freezing uses), so the
  per-call repacking of the weight that ``F.linear`` does for a GEMM of a few rows is gone.

Neither changes a bit. From :func:`model.batch_invariant.min_rows` rows up (where ``F.linear``
runs the one GEMM kernel whose rows do not depend on the other rows), the columns of a fused
product are those of the separate products and a packed product gives ``F.linear``'s bits;
below it ``F.linear`` picks other kernels (a matrix-vector product for one row) whose results
depend on the matrix's shape, so there a :class:`Projection` runs the separate matrices
unpacked, as before. A deterministic model's packed products are the exception: MKL's packed
GEMM gives every row the row-invariant bits from fewer rows than ``F.linear`` needs (from 1
row where ``F.linear`` needs 16, on an AVX-512 Xeon), probed by :func:`exact_floor`, so its
steps are padded to that floor, not to 16 rows. These claims are measured on this
repository's torch/MKL, and :func:`is_exact` checks them on this machine once per shape and
process before a product is fused or packed. So greedy output, the fast mode's agreement with transformers and the
deterministic mode's bitwise agreement with the trainer (whose dense forward keeps the separate
parameters and plain ``F.linear``) all stay as they were.

The prepared matrices are the engine's own copies (the parameters stay zero-copy views of the
weight store's memory): the fused q/k/v and gate/up matrices and the packed forms, about three
times the weights again (MKL's packed layout is larger than the matrix). That pays only while
a step's weights stay in the CPU's caches: on the tiny model (17 MB) a deterministic step got
5-10 % faster; on SmolLM2-135M (538 MB, streamed from memory each step) it got nothing and
would hold 1.5 GB more per engine process. So only models up to :data:`PREPARE_MAX_BYTES` are
prepared; larger ones run the parameters as they are. The checkpoint format does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from model import batch_invariant as bi

if TYPE_CHECKING:
    from model.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

PREPARE_MAX_BYTES = 64 * 2**20
"""Largest model (bytes of its parameters, tied ones once) :func:`prepare_for_inference`
prepares: about what a shared L3 cache keeps between decode steps (see the module doc)."""

_EXACT: dict[tuple[tuple[tuple[int, int], ...], bool, int], bool] = {}
""":func:`is_exact`'s probes, by shapes, packed and floor."""
_EXACT_ANY_COUNT: dict[tuple[tuple[tuple[int, int], ...], int], bool] = {}
""":func:`exact_any_count`'s probes, by shapes and floor."""


@dataclass(frozen=True)
class Projection:
    """``torch.cat([F.linear(x, w) for w in parts], -1)`` for the engine (no autograd), bit for bit.

    ``weight`` stacks the ``parts`` (the same tensor when there is one); ``packed`` is its
    MKL-packed form or None. From ``min_rows`` rows up the product runs on ``packed`` (else
    ``weight``) in one call; below, on each part with ``F.linear``. ``exact_rows``: from this
    many rows up every row of the result has the bits the row-invariant GEMM gives it (what a
    deterministic caller pads its rows to; :func:`model.batch_invariant.bucket`).
    """

    parts: tuple[Tensor, ...]
    weight: Tensor
    packed: Tensor | None = None
    min_rows: int = bi.MIN_GEMM_ROWS
    exact_rows: int = bi.MIN_GEMM_ROWS
    any_count: bool = False

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < self.min_rows:
            if len(self.parts) == 1:
                return F.linear(x, self.weight)
            return torch.cat([F.linear(x, w) for w in self.parts], dim=-1)
        if self.packed is None:
            return F.linear(x, self.weight)
        return _MKL_LINEAR(x, self.packed, self.weight, None, rows)


def _mkl_linear(x: Tensor, packed: Tensor, weight: Tensor, bias: None, rows: int) -> Tensor:
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


_MKL_LINEAR = (
    torch.ops.mkl._mkl_linear.default if hasattr(torch.ops.mkl, "_mkl_linear") else _mkl_linear
)
"""MKL's packed product, its overload resolved once (an overload packet's call costs a few
microseconds of Python, 17 times a decode step)."""


def can_pack(weight: Tensor) -> bool:
    """MKL packing is there for this weight (fp32 on the CPU, torch built with MKL)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def pack(weight: Tensor) -> Tensor:
    """``weight`` ``[n, k]`` packed for MKL's sgemm (the packing does not depend on the rows)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, bi.MIN_GEMM_ROWS)


def floor_rows(shapes: tuple[tuple[int, int], ...]) -> int:
    """The fewest rows from which the parts (``[n, k]`` each) and their stack all run the
    row-invariant GEMM (:func:`model.batch_invariant.min_rows`)."""
    k = shapes[0][1]
    stacked = sum(n for n, _ in shapes)
    return max(bi.min_rows("linear", k, n) for n in (stacked, *(n for n, _ in shapes)))


def is_exact(shapes: tuple[tuple[int, int], ...], packed: bool, floor: int | None = None) -> bool:
    """Whether a :class:`Projection` of fp32 parts of these ``[n, k]`` shapes, stacked and
    ``packed`` or not, in one call from ``floor`` rows (default :func:`floor_rows`), gives every
    row the bits the separate ``F.linear`` products give it among many rows (the row-invariant
    GEMM), for every bucket of rows from ``floor`` up and a few larger counts, rows taken from
    the start and from the end of a batch, on this machine (probed once per shapes and process:
    the kernels depend on the shapes, not the values)."""
    floor = floor_rows(shapes) if floor is None else floor
    key = (shapes, packed, floor)
    found = _EXACT.get(key)
    if found is None:
        found = _EXACT[key] = _probe(shapes, packed, floor)
    return found


def exact_floor(shapes: tuple[tuple[int, int], ...]) -> int:
    """The fewest rows (a bucket) from which a packed :class:`Projection` of these shapes gives
    every row the row-invariant GEMM's bits (:func:`is_exact`): MKL's packed GEMM runs one
    kernel whatever the rows where plain ``F.linear`` switches kernels below
    :func:`floor_rows` (16 rows on an AVX-512 Xeon, 1 or 2 packed, measured 2026-12-06), so a
    deterministic step of 8 rows need not pay for 16. At most :func:`floor_rows`."""
    floor = floor_rows(shapes)
    return next(b for b in bi.ROW_BUCKETS if b >= floor or is_exact(shapes, True, b))


def exact_any_count(shapes: tuple[tuple[int, int], ...], floor: int) -> bool:
    """Whether a packed :class:`Projection` of these shapes gives every row the row-invariant
    GEMM's bits for every count of rows from ``floor`` up, not only ``ROW_BUCKETS``' (probed
    like :func:`is_exact`, every count from ``floor`` to ``MIN_GEMM_ROWS`` and a few larger).
    Measured true from 4 rows on an AMD EPYC (AVX2, 2026-12-07): MKL's packed GEMM runs one
    kernel for 4 or more rows, so a deterministic step of 13 rows need not pay for 16."""
    found = _EXACT_ANY_COUNT.get((shapes, floor))
    if found is None:
        counts = list(range(floor, bi.MIN_GEMM_ROWS + 1))
        found = _EXACT_ANY_COUNT[(shapes, floor)] = _probe(shapes, True, floor, counts)
    return found


def _probe(
    shapes: tuple[tuple[int, int], ...], packed: bool, floor: int, counts: list[int] | None = None
) -> bool:
    k, most = shapes[0][1], 64
    gen = torch.Generator().manual_seed(7_000_003 * k + sum(n for n, _ in shapes))
    counts = [b for b in bi.ROW_BUCKETS if b >= floor] if counts is None else counts
    counts = [*counts, bi.MIN_GEMM_ROWS + 1, 37]
    with torch.inference_mode(), bi.one_thread():
        parts = tuple(torch.randn(n, k, generator=gen) for n, _ in shapes)
        product = _projection(parts, packed, floor)
        x = torch.randn(most, k, generator=gen)
        ref = torch.cat([F.linear(x, w) for w in parts], dim=-1)  # the row-invariant GEMM's rows
        for m in counts:
            head, tail = x[:m].clone(), x[most - m :].clone()
            if not torch.equal(product(head), ref[:m]):
                return False
            if not torch.equal(product(tail), ref[most - m :]):
                return False
    return True


def _projection(
    parts: tuple[Tensor, ...], packed: bool, floor: int, any_count: bool = False
) -> Projection:
    weight = parts[0] if len(parts) == 1 else torch.cat(parts)
    return Projection(parts, weight, pack(weight) if packed else None, floor, floor, any_count)


def projection(weights: list[Tensor], deterministic: bool = False) -> Projection:
    """One product for ``weights`` (``[n, k]`` each, the same ``k``): stacked and packed where
    :func:`is_exact` says so on this machine, stacked only, or as they are. ``deterministic``
    (a deterministic model's product, always called with rows padded to its ``exact_rows``):
    a packed product runs in one call from :func:`exact_floor` rows, not from
    :func:`floor_rows` (below which a fast model's parts run alone, as ``F.linear`` would),
    and with ``any_count`` where :func:`exact_any_count` holds from there."""
    parts, shapes = tuple(weights), tuple((w.shape[0], w.shape[1]) for w in weights)
    floor = floor_rows(shapes)
    if can_pack(weights[0]) and is_exact(shapes, True):
        if not deterministic:
            return _projection(parts, True, floor)
        exact = exact_floor(shapes)
        return _projection(parts, True, exact, exact_any_count(shapes, exact))
    if len(parts) > 1 and is_exact(shapes, False):
        return _projection(parts, False, floor)
    if len(parts) == 1:
        return Projection(parts, parts[0], None, floor, floor)
    # Never one call: min_rows above every row count keeps the parts apart.
    return Projection(parts, parts[0], None, min_rows=2**62, exact_rows=floor)


def prepare_for_inference(model: Qwen3ForCausalLM) -> bool:
    """Give ``model`` (built by :func:`model.qwen3.build_model`, not trained afterwards: the
    prepared matrices are copies) its fused and packed products; its paged forward and
    :meth:`~model.qwen3.Qwen3ForCausalLM.compute_logits` then use them. The dense (training)
    forward keeps the parameters. Call again after the weights change. A model over
    :data:`PREPARE_MAX_BYTES`, or not on the CPU (the exactness probes run the CPU's kernels),
    is left as it is; returns whether it was prepared."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size > PREPARE_MAX_BYTES or model.lm_head.weight.device.type != "cpu":
        return False
    det = model.deterministic
    with torch.no_grad():
        for module in model.model.layers:
            layer = cast("Qwen3DecoderLayer", module)
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            attn.qkv = projection(qkv, det)
            if attn.q_norm is not None and attn.k_norm is not None:
                heads = (attn.num_heads, attn.num_kv_heads)
                norms = (attn.q_norm.weight, attn.k_norm.weight)
                stacked = [w.expand(n, attn.head_dim) for w, n in zip(norms, heads, strict=True)]
                attn.qk_norm_weight = torch.cat(stacked)
            attn.o = projection([attn.o_proj.weight], det)
            mlp.gate_up = projection([mlp.gate_proj.weight, mlp.up_proj.weight], det)
            mlp.down = projection([mlp.down_proj.weight], det)
        model.head = projection([model.output_weight()], det)
    return True
