"""The dense training forward against the paged inference forward and the engine's logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from model.config import ModelConfig, load_model_config
from model.loader import load_safetensors
from model.qwen3 import AttentionMetadata, Qwen3ForCausalLM, build_model, kv_cache_shape
from model.train_forward import build_trainable_model, dense_forward, token_logprobs
from services.worker.engine.config import EngineConfig
from services.worker.engine.sequence import SamplingParams
from tests.unit.model_fixtures import make_engine, write_small_model

torch.set_num_threads(1)

ATOL = 1e-5
PAD = 0
PROMPTS = [[(11 * i + 1) % 512 for i in range(7)], [(13 * i + 5) % 512 for i in range(19)]]
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_model(tmp_path_factory.mktemp("small-model"))


@pytest.fixture(scope="module")
def cfg(model_dir: Path) -> ModelConfig:
    return load_model_config(model_dir)


@pytest.fixture(scope="module")
def tensors(model_dir: Path) -> dict[str, Tensor]:
    return load_safetensors(model_dir)


def paged_logits(model: Qwen3ForCausalLM, tokens: list[int], num_prefill: int) -> Tensor:
    """Logits at every position: a prefill of ``num_prefill`` tokens, then one decode step per
    remaining token, over shuffled KV blocks (position p lives in ``table[p // 8]``)."""
    cfg, block_size = model.config, 8
    table = [5, 2, 7, 0, 3, 6, 1, 4]
    kv = torch.zeros(kv_cache_shape(cfg, len(table), block_size))
    slots = torch.tensor(
        [table[p // block_size] * block_size + p % block_size for p in range(len(tokens))]
    )
    with torch.inference_mode():
        attn = AttentionMetadata.prefill(slots[:num_prefill], [num_prefill])
        hidden = model(torch.tensor(tokens[:num_prefill]), torch.arange(num_prefill), attn, kv)
        out = [model.compute_logits(hidden)]
        for p in range(num_prefill, len(tokens)):
            blocks = torch.tensor([table[: p // block_size + 1]])
            attn = AttentionMetadata.decode(slots[p : p + 1], blocks, torch.tensor([p + 1]), 8)
            hidden = model(torch.tensor(tokens[p : p + 1]), torch.tensor([p]), attn, kv)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def padded(rows: list[list[int]], left: bool) -> tuple[Tensor, Tensor]:
    """``input_ids`` and ``attention_mask`` for ``rows``, padded on the left or the right."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def max_diff(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max())


def test_dense_logits_match_paged_prefill_and_decode(
    cfg: ModelConfig, tensors: dict[str, Tensor]
) -> None:
    model = build_model(cfg, tensors)
    tokens = [(5 * i + 3) % 512 for i in range(30)]
    ref = paged_logits(model, tokens, num_prefill=21)
    with torch.no_grad():
        dense = dense_forward(model, torch.tensor([tokens]))[0]
        # The trainable copy computes the same thing, with or without an all-ones mask.
        trainable = build_trainable_model(cfg, tensors)
        masked = dense_forward(trainable, torch.tensor([tokens]), torch.ones(1, 30))[0]
    assert dense.shape == (30, cfg.vocab_size) and dense.dtype == torch.float32
    assert max_diff(dense, ref) <= ATOL
    assert max_diff(masked, ref) <= ATOL


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_token_logprobs_match_the_engine(
    model_dir: Path, cfg: ModelConfig, tensors: dict[str, Tensor], kind: str
) -> None:
    sampling = SAMPLINGS[kind]
    engine = make_engine(model_dir, EngineConfig(block_size=8, num_blocks=64, max_model_len=128))
    results = engine.generate(PROMPTS, sampling)
    temperature = sampling.temperature or 1.0
    model = build_trainable_model(cfg, tensors)
    seqs = [p + r.token_ids for p, r in zip(PROMPTS, results, strict=True)]
    ids, mask = padded(seqs, left=False)
    with torch.no_grad():
        batch = token_logprobs(model, ids, mask, temperature=temperature)
    for i, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
        assert len(result.logprobs) == sampling.max_tokens
        engine_lp = torch.tensor(result.logprobs)
        with torch.no_grad():
            alone = token_logprobs(model, torch.tensor([seqs[i]]), temperature=temperature)[0]
        start, end = len(prompt) - 1, len(seqs[i]) - 1
        assert max_diff(alone[start:], engine_lp) <= ATOL
        assert max_diff(batch[i, start:end], engine_lp) <= ATOL


@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
def test_padded_batch_matches_each_row_alone(
    cfg: ModelConfig, tensors: dict[str, Tensor], left: bool
) -> None:
    model = build_trainable_model(cfg, tensors)
    rows = [[(3 * i + 7) % 512 for i in range(9)], [(17 * i + 2) % 512 for i in range(17)]]
    ids, mask = padded(rows, left)
    with torch.no_grad():
        batch_lp = token_logprobs(model, ids, mask)
        batch_logits = dense_forward(model, ids, mask)
        for i, row in enumerate(rows):
            alone_lp = token_logprobs(model, torch.tensor([row]))[0]
            alone_logits = dense_forward(model, torch.tensor([row]))[0]
            real = mask[i].bool()
            # Valid log-probs: both the context position and the target are real tokens.
            valid = real[:-1] & real[1:]
            assert int(valid.sum()) == len(row) - 1
            assert max_diff(batch_lp[i][valid], alone_lp) <= ATOL
            assert bool((batch_lp[i][~valid] == 0).all())
            assert max_diff(batch_logits[i][real], alone_logits) <= ATOL
            assert bool(batch_logits[i].isfinite().all())


def test_gradients_reach_every_parameter_and_the_state_dict_serves(
    cfg: ModelConfig, tensors: dict[str, Tensor]
) -> None:
    model = build_trainable_model(cfg, tensors)
    ids, mask = padded([[(3 * i + 7) % 512 for i in range(9)], list(range(40, 57))], left=True)
    loss = -token_logprobs(model, ids, mask).sum() / mask[:, 1:].sum()
    loss.backward()
    params = dict(model.named_parameters())
    assert len(params) == len(tensors)
    for name, param in params.items():
        assert param.grad is not None, name
        assert bool(param.grad.isfinite().all()) and float(param.grad.abs().sum()) > 0, name
    # Padding contributes nothing: the pad id (never a real token here) gets no gradient.
    embed_grad = model.model.embed_tokens.weight.grad
    assert embed_grad is not None and float(embed_grad[PAD].abs().sum()) == 0

    before = {n: t.clone() for n, t in tensors.items()}
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    # The trainer owns its copies: the source tensors (shared memory in production) are intact.
    assert all(torch.equal(tensors[n], before[n]) for n in tensors)
    assert not torch.equal(params["lm_head.weight"], tensors["lm_head.weight"])

    # The updated state dict loads into the serving model and both paths agree on it.
    served = build_model(cfg, model.state_dict())
    tokens = [(5 * i + 3) % 512 for i in range(12)]
    with torch.no_grad():
        dense = dense_forward(model, torch.tensor([tokens]))[0]
    assert max_diff(dense, paged_logits(served, tokens, num_prefill=12)) <= ATOL


def test_rejects_bad_shapes(cfg: ModelConfig, tensors: dict[str, Tensor]) -> None:
    model = build_model(cfg, tensors)
    with pytest.raises(ValueError, match="batch, tokens"):
        dense_forward(model, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        dense_forward(model, torch.tensor([[1, 2, 3]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, torch.tensor([[1, 2, 3]]), temperature=0)


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
@pytest.mark.parametrize("left", [False, True], ids=["right-pad", "left-pad"])
def test_deterministic_token_logprobs_are_bitwise_the_engines(
    model_dir: Path, cfg: ModelConfig, tensors: dict[str, Tensor], kind: str, left: bool
) -> None:
    """True on-policy: with deterministic mode on both sides the trainer's log-probabilities
    of a trajectory are exactly those the engine reported while sampling it (batched with
    other requests), whatever the padding and the other rows of the training batch."""
    sampling = SAMPLINGS[kind]
    config = EngineConfig(block_size=8, num_blocks=64, max_model_len=128, deterministic=True)
    engine = make_engine(model_dir, config)
    prompts = [*PROMPTS, [(7 * i + 2) % 512 for i in range(3)], [9] * 40]
    results = engine.generate(prompts, sampling)
    temperature = sampling.temperature or 1.0
    model = build_trainable_model(cfg, tensors, deterministic=True)
    seqs = [p + r.token_ids for p, r in zip(prompts, results, strict=True)]
    ids, mask = padded(seqs, left=left)
    with torch.no_grad():
        batch = token_logprobs(model, ids, mask, temperature=temperature)
    width = ids.shape[1]
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        engine_lp = torch.tensor(result.logprobs)
        pad = width - len(seqs[i]) if left else 0
        start, end = pad + len(prompt) - 1, pad + len(seqs[i]) - 1
        assert torch.equal(batch[i, start:end], engine_lp), f"row {i}"
        with torch.no_grad():
            alone = token_logprobs(model, torch.tensor([seqs[i]]), temperature=temperature)[0]
        assert torch.equal(alone[len(prompt) - 1 :], engine_lp)


def test_deterministic_forward_trains(cfg: ModelConfig, tensors: dict[str, Tensor]) -> None:
    """The deterministic dense forward is differentiable: finite gradients everywhere, and
    its values agree with the default forward to rounding."""
    model = build_trainable_model(cfg, tensors, deterministic=True)
    ids, mask = padded([[(3 * i + 7) % 512 for i in range(9)], list(range(40, 200))], left=True)
    lp = token_logprobs(model, ids, mask)
    with torch.no_grad():
        fast = token_logprobs(build_trainable_model(cfg, tensors), ids, mask)
    assert max_diff(lp.detach(), fast) <= ATOL
    (-lp.sum()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and bool(param.grad.isfinite().all()), name
        assert float(param.grad.abs().sum()) > 0, name
    with pytest.raises(ValueError, match="contiguous"):
        token_logprobs(model, ids[:1], torch.tensor([[1, 0, 1] + [1] * (ids.shape[1] - 3)]))
