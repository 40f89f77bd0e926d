"""The engine's fused and packed products (``model.fused``) change no bit: a prepared model's
paged forward gives exactly the logits of the plain one, in fast and deterministic mode, for
Qwen3 (q/k norms) and Llama (none), at prefill and at decode batches of 1 and 8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from model import batch_invariant as bi
from model import fused
from model.config import load_model_config
from model.fused import (
    Projection,
    can_pack,
    floor_rows,
    is_exact,
    pack,
    prepare_for_inference,
    projection,
)
from model.loader import load_safetensors
from model.qwen3 import AttentionMetadata, Qwen3ForCausalLM, build_model, kv_cache_shape
from model.tiny import init_tiny_model

torch.set_num_threads(1)

BLOCK = 8
PROMPTS = [[(7 * j + 3 * i + 1) % 500 for j in range(5 + 9 * i)] for i in range(8)]
"""Eight prompts of 5 to 68 tokens."""


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    shape |= {"head_dim": 32, "intermediate_size": 200, "vocab_size": 512}
    out = tmp_path_factory.mktemp(request.param) / "model"
    return init_tiny_model(out, model_type=request.param, **shape)


def step_logits(model: Qwen3ForCausalLM, batch: int) -> Tensor:
    """Logits of a prefill of ``batch`` prompts, then of three decode steps of all of them."""
    cfg = model.config
    per_seq = 16
    kv = torch.zeros(kv_cache_shape(cfg, batch * per_seq, BLOCK))
    seqs = [list(p) for p in PROMPTS[:batch]]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    out = []
    with torch.inference_mode():
        slots = [
            t[p // BLOCK] * BLOCK + p % BLOCK
            for s, t in zip(seqs, tables, strict=True)
            for p in range(len(s))
        ]
        attn = AttentionMetadata.prefill(torch.tensor(slots), [len(s) for s in seqs])
        ids = torch.tensor([x for s in seqs for x in s])
        pos = torch.tensor([p for s in seqs for p in range(len(s))])
        out.append(model.compute_logits(model(ids, pos, attn, kv)))
        for step in range(3):
            for s in seqs:
                s.append((step * 31 + len(s)) % 500)
            pos = torch.tensor([len(s) - 1 for s in seqs])
            slots = [
                t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(tables, pos.tolist(), strict=True)
            ]
            width = max(len(s) - 1 for s in seqs) // BLOCK + 1
            attn = AttentionMetadata.decode(
                torch.tensor(slots), torch.tensor([t[:width] for t in tables]), pos + 1, BLOCK
            )
            ids = torch.tensor([s[-1] for s in seqs])
            out.append(model.compute_logits(model(ids, pos, attn, kv)))
    return torch.cat(out)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("batch", [1, 5, 8])
def test_prepared_products_give_the_plain_models_bits(
    model_dir: Path, deterministic: bool, batch: int
) -> None:
    """Batch 5, not a bucket: where the prepared products are exact for any count
    (``Projection.any_count``) a deterministic step runs 5 rows, the plain model 8 (or 16)."""
    cfg, tensors = load_model_config(model_dir), load_safetensors(model_dir)
    # Norm weights of their own (the tiny model's are ones), so that the prepared model's
    # one norm of the q and k heads must scale each head by the right weight.
    gen = torch.Generator().manual_seed(5)
    for name, value in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * torch.randn(value.shape, generator=gen)
    plain = build_model(cfg, tensors, deterministic=deterministic)
    prepared = build_model(cfg, tensors, deterministic=deterministic)
    prepare_for_inference(prepared)
    assert prepared.head is not None
    assert torch.equal(step_logits(prepared, batch), step_logits(plain, batch))
    assert prepared.state_dict().keys() == plain.state_dict().keys()  # the format is unchanged


def test_a_model_over_the_bound_is_left_as_it_is(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model(load_model_config(model_dir), load_safetensors(model_dir))
    monkeypatch.setattr(fused, "PREPARE_MAX_BYTES", 1024)
    assert not prepare_for_inference(model)
    assert model.head is None
    assert all(layer.self_attn.qkv is None for layer in model.model.layers)  # type: ignore[union-attr]  # layers are Qwen3DecoderLayers


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="torch built without MKL")
@pytest.mark.parametrize(
    "shapes",
    [((768, 256),), ((256, 768),), ((4096, 256),), ((128, 128), (64, 128), (64, 128))],
    ids=["up", "down", "head", "qkv-128"],
)
def test_a_projection_is_the_separate_products_for_any_rows(
    shapes: tuple[tuple[int, int], ...],
) -> None:
    """Measured on this machine: what ``prepare_for_inference`` relies on where it fuses and
    packs (for one row, a stacked matrix is *not* bitwise its parts: the fallback is needed)."""
    assert is_exact(shapes, packed=True)
    gen = torch.Generator().manual_seed(len(shapes))
    parts = tuple(torch.randn(n, k, generator=gen) for n, k in shapes)
    weight = torch.cat(parts)
    product = Projection(parts, weight, pack(weight), floor_rows(shapes))
    x = torch.randn(70, shapes[0][1], generator=gen)
    for m in (*range(1, 20), 33, 70):
        rows = x[:m].clone()
        assert torch.equal(product(rows), torch.cat([F.linear(rows, w) for w in parts], -1)), m


@pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="torch built without MKL")
@pytest.mark.parametrize(
    "shapes",
    [((768, 256),), ((256, 768),), ((2042, 256),), ((128, 128), (64, 128), (64, 128))],
    ids=["up", "down", "head", "qkv-128"],
)
def test_a_deterministic_projection_has_the_row_invariant_bits_from_its_floor(
    shapes: tuple[tuple[int, int], ...],
) -> None:
    """A deterministic model's product runs in one call from ``exact_rows`` rows, which may be
    fewer than plain ``F.linear`` needs (MKL's packed GEMM: 1 on an AVX-512 Xeon, where
    ``F.linear`` needs 16); from there every row has the bits it gets among 70 rows, on data
    other than the probe's, taken from the start and from the end of the batch."""
    gen = torch.Generator().manual_seed(11 + len(shapes))
    parts = [torch.randn(n, k, generator=gen) for n, k in shapes]
    product = projection(parts, deterministic=True)
    assert product.exact_rows <= floor_rows(shapes)
    x = torch.randn(70, shapes[0][1], generator=gen)
    ref = torch.cat([F.linear(x, w) for w in parts], -1)
    counts = [b for b in bi.ROW_BUCKETS if b >= product.exact_rows] + [17, 33, 70]
    if product.any_count:  # every count from the floor, not only the buckets
        counts += list(range(product.exact_rows, bi.MIN_GEMM_ROWS))
    for m in counts:
        assert torch.equal(product(x[:m].clone()), ref[:m]), m
        assert torch.equal(product(x[70 - m :].clone()), ref[70 - m :]), m
