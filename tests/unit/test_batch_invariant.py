"""The batch-invariant primitives of deterministic mode, checked on the machine the tests run on.

``model/batch_invariant.py`` rests on measured properties of torch/MKL on CPU with one thread
(a matmul with >= ``MIN_GEMM_ROWS`` rows gives each row the same bits whatever the other rows; ``exp``,
division, RMSNorm, ``log_softmax`` are row-wise); these tests fail if a torch or BLAS upgrade
breaks one, before any engine test does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import batch_invariant as bi

torch.set_num_threads(1)

GEN = torch.Generator().manual_seed(0)
SHAPES = [(64, 128), (64, 512), (256, 768), (768, 256), (256, 4096), (1000, 37)]


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_linear_rows_do_not_depend_on_the_other_rows(k: int, n: int) -> None:
    w, x = randn(n, k), randn(300, k)
    alone = torch.cat([bi.linear(x[i : i + 1], w) for i in range(40)])
    for m in (1, 2, 3, 4, 5, 8, 17, 40, 300):
        assert torch.equal(bi.linear(x[:m], w)[:40], alone[:m])
    perm = torch.randperm(40, generator=GEN)
    assert torch.equal(bi.linear(x[:40][perm], w), alone[perm])
    # Any leading shape, and with autograd on (the trainer's path): the same bits.
    wg = w.clone().requires_grad_(True)
    assert torch.equal(bi.linear(x[:40].view(4, 10, k), wg).detach().view(40, n), alone)


def test_linear_matches_f_linear_to_rounding() -> None:
    w, x = randn(256, 64), randn(3, 64)
    assert torch.allclose(bi.linear(x, w), F.linear(x, w), atol=1e-5)


def test_silu_is_row_invariant_and_is_silu() -> None:
    x = randn(80, 100) * 4
    alone = torch.cat([bi.silu(x[i : i + 1]) for i in range(80)])
    assert all(torch.equal(bi.silu(x[:m]), alone[:m]) for m in (1, 2, 3, 7, 80))
    assert torch.allclose(bi.silu(x), F.silu(x), atol=1e-6)
    xg = torch.tensor([-200.0, -90.0, 0.0, 5.0], requires_grad=True)
    bi.silu(xg).sum().backward()
    assert xg.grad is not None and bool(xg.grad.isfinite().all())


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal softmax attention for one sequence: q ``[n, h, d]``, k/v ``[n, kvh, d]``."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / q.shape[-1] ** 0.5
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``bi.attend`` laid out as the model does for one sequence (tokens × query heads)."""
    n, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    length = bi.chunks_for(n) * bi.ATTENTION_CHUNK
    kv = F.pad(torch.stack([k, v]), (0, 0, 0, 0, 0, length - n))
    rows = q.view(n, kvh, g, d).permute(1, 0, 2, 3).reshape(1, kvh, n * g, d)
    pos = torch.arange(n).repeat_interleave(g)[None]
    out = bi.attend(rows, pos, bi.chunk_kv(kv, 1))
    return out.view(kvh, n, g, d).permute(1, 0, 2, 3).reshape(n, h, d)


def test_chunked_attention_is_attention_and_each_query_only_sees_its_past() -> None:
    n = 2 * bi.ATTENTION_CHUNK + 37  # three chunks, the last one partial
    q, k, v = randn(n, 4, 16), randn(n, 2, 16), randn(n, 2, 16)
    out = attend_sequence(q, k, v)
    assert torch.allclose(out, reference_attention(q, k, v), atol=1e-5)
    # A query's output is bitwise the same from a shorter prefix (fewer chunks, other keys in
    # its last chunk): position p depends on keys 0..p only.
    for p in (0, 5, bi.ATTENTION_CHUNK - 1, bi.ATTENTION_CHUNK, n - 2):
        short = attend_sequence(q[: p + 1], k[: p + 1], v[: p + 1])
        assert torch.equal(short[p], out[p]), p


def masked_online_softmax(q: torch.Tensor, q_pos: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``bi.attend``'s chunked online softmax written the direct way: hidden keys' scores set to
    ``-inf`` before ``exp`` (its formulation before 2026-12-06; the same ops otherwise)."""
    s, kvh, m, hd = q.shape
    c, chunks = kv.shape[4], kv.shape[1]
    need = max(bi.padded_rows("qk", hd, c, m), bi.padded_rows("pv", c, hd, m))
    qp, _ = bi.pad_rows(q, 2, need)
    rows = qp.shape[2]
    qf = qp.reshape(s * kvh, rows, hd)
    pos, _ = bi.pad_rows(q_pos, 1, need)
    hidden = torch.arange(chunks * c).view(chunks, 1, 1, 1, c) > pos[None, :, None, :, None]
    mx = denom = acc = qf
    for i in range(chunks):
        k, v = kv[0, i].view(s * kvh, c, hd), kv[1, i].view(s * kvh, c, hd)
        scores = torch.matmul(qf, k.transpose(1, 2)) * hd**-0.5
        scores = scores.view(s, kvh, rows, c).masked_fill(hidden[i], float("-inf"))
        scores = scores.view(s * kvh, rows, c)
        if i == 0:
            mx = scores.amax(dim=-1)
            p = torch.exp(scores - mx[..., None])
            denom, acc = p.sum(dim=-1), torch.matmul(p, v)
        else:
            new = torch.maximum(mx, scores.amax(dim=-1))
            alpha = torch.exp(mx - new)
            p = torch.exp(scores - new[..., None])
            denom = denom * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v)
            mx = new
    return (acc / denom[..., None]).view(s, kvh, rows, hd)[:, :, :m]


@pytest.mark.parametrize(("s", "m", "chunks"), [(3, 2, 1), (2, 4, 2), (1, 16, 3), (1, 200, 4)])
def test_attend_has_the_bits_of_masking_to_minus_infinity_forward_and_backward(
    s: int, m: int, chunks: int
) -> None:
    """``bi.attend`` zeroes hidden keys around ``exp`` instead of masking their scores to
    ``-inf`` (a slow path of ``exp``): the outputs and the gradients (the trainer's) are
    bitwise the direct way's, for decode rows, draft groups and a training sequence."""
    q0 = randn(s, 2, m, 64)
    kv0 = randn(2, chunks, s, 2, bi.ATTENTION_CHUNK, 64) * 3
    q_pos = torch.randint(0, chunks * bi.ATTENTION_CHUNK, (s, m), generator=GEN)
    weight = randn(s, 2, m, 64)
    results = []
    for attend in (bi.attend, masked_online_softmax):
        q, kv = q0.clone().requires_grad_(True), kv0.clone().requires_grad_(True)
        out = attend(q, q_pos, kv)
        (out * weight).sum().backward()
        results.append((out.detach(), q.grad, kv.grad))
    for ours, direct in zip(*results, strict=True):
        assert torch.equal(ours, direct)


@pytest.mark.parametrize(
    ("s", "m", "chunks", "lowest"),
    [(8, 4, 2, 100), (8, 2, 2, 250), (2, 16, 3, 200), (8, 4, 8, 900), (1, 6, 4, 300)],
)
def test_the_engine_s_stacked_chunks_have_the_bits_of_the_trainer_s_loop(
    s: int, m: int, chunks: int, lowest: int
) -> None:
    """Without gradients, a decode step over two or more chunks runs them stacked
    (``_attend_stacked``: each product, maximum, ``exp`` and sum once for every chunk); with
    gradients (the trainer) ``attend`` loops over the chunks. Their outputs are bitwise equal
    for decode rows and draft groups of several lengths, with each row at its own position."""
    q = randn(s, 2, m, 64)
    kv = randn(2, chunks, s, 2, bi.ATTENTION_CHUNK, 64) * 3
    top = min(chunks * bi.ATTENTION_CHUNK, lowest + 150)
    q_pos = torch.randint(lowest, top, (s, m), generator=GEN)
    loop = bi.attend(q.clone().requires_grad_(True), q_pos, kv).detach()
    cache: dict[str, object] = {}
    with torch.inference_mode():
        stacked = bi.attend(q, q_pos, kv, cache)
    plan = cache[f"attend-{m}-{chunks}"]
    assert getattr(plan, "stacked", None) is not None  # the stacked path ran
    assert torch.equal(stacked, loop)


def test_one_thread_restores_the_thread_count() -> None:
    torch.set_num_threads(2)
    try:
        with bi.one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize(("k", "n"), [(256, 768), (768, 256), (256, 4096)])
def test_padding_to_the_probed_bucket_gives_the_bits_of_sixteen_rows(k: int, n: int) -> None:
    """``min_rows`` only saves work: every bucket from it pads to the bits of 16 rows, for
    the three products of the deterministic forward."""
    floor = bi.min_rows("linear", k, n)
    assert floor in bi.ROW_BUCKETS
    w, x = randn(n, k), randn(bi.MIN_GEMM_ROWS, k)
    sixteen = F.linear(x, w)
    for m in range(1, bi.MIN_GEMM_ROWS):
        rows = bi.bucket(m, floor)
        assert rows >= max(m, floor) and rows in bi.ROW_BUCKETS
        padded = torch.cat([x[:m], x.new_zeros(rows - m, k)])
        assert torch.equal(F.linear(padded, w)[:m], sixteen[:m]), m
        assert torch.equal(bi.linear(x[:m], w), sixteen[:m]), m
    q, keys = randn(1, bi.MIN_GEMM_ROWS, 64), randn(1, bi.ATTENTION_CHUNK, 64)
    scores = torch.matmul(q, keys.transpose(1, 2))
    rows = bi.padded_rows("qk", 64, bi.ATTENTION_CHUNK, 2)
    assert torch.equal(torch.matmul(q[:, :rows], keys.transpose(1, 2))[:, :2], scores[:, :2])
    assert bi.bucket(bi.MIN_GEMM_ROWS + 3, floor) == bi.MIN_GEMM_ROWS + 3


def test_products_exact_for_any_count_are_padded_only_up_to_their_floor() -> None:
    """``any_count`` (a prepared product exact for every count of rows from its floor) keeps
    a count at or above the floor as it is; below it, or without it, the bucket."""
    assert [bi.bucket(m, 4, any_count=True) for m in (1, 3, 4, 5, 13, 16, 19)] == [
        4,
        4,
        4,
        5,
        13,
        16,
        19,
    ]
    assert [bi.bucket(m, 4) for m in (1, 3, 4, 5, 13, 16, 19)] == [4, 4, 4, 8, 16, 16, 19]
    assert bi.bucket(5, 16, any_count=True) == 16
