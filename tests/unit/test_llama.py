"""The Llama family on Belayer's decoder: a tiny random Llama (no q/k norms, tied embeddings,
RoPE base 10000, grouped-query heads) against Hugging Face's ``LlamaForCausalLM`` on the same
directory, and the trainer's dense forward against the engine's log-probabilities."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from model.config import load_model_config
from model.loader import load_safetensors
from model.tiny import init_tiny_model
from model.train_forward import build_trainable_model, token_logprobs
from services.worker.engine.config import EngineConfig
from services.worker.engine.sequence import SamplingParams
from tests.unit.model_fixtures import make_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)

NEW_TOKENS = 24
TINY_LLAMA = {
    "hidden_size": 192,
    "num_layers": 3,
    "num_heads": 6,
    "num_kv_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 1024,
}
PROMPTS = [
    [17],
    [(11 * i + 1) % 900 for i in range(7)],
    [(13 * i + 5) % 900 for i in range(19)],
    [(7 * i + 2) % 900 for i in range(40)],
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("llama"), **TINY_LLAMA, model_type="llama")


@pytest.fixture(scope="module")
def hf_llama(llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model: Any, prompt: list[int], n: int, limit: int) -> list[int]:
    """Argmax over a full forward of the whole sequence, n times, among the tokenizer's ids."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids])).logits[0, -1, :limit]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_the_tiny_llama_is_a_llama(llama_dir: Path, hf_llama: Any) -> None:
    cfg = load_model_config(llama_dir)
    assert cfg.model_type == "llama" and not cfg.family.qk_norm
    assert cfg.tie_word_embeddings and cfg.rope_theta == 10_000.0 and cfg.num_kv_groups == 3
    tensors = load_safetensors(llama_dir)
    assert "lm_head.weight" not in tensors
    assert not any("q_norm" in name or "k_norm" in name for name in tensors)
    assert type(hf_llama).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_engine_greedy_equals_transformers(
    llama_dir: Path, hf_llama: Any, deterministic: bool
) -> None:
    config = EngineConfig(
        block_size=8,
        num_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=512,
        deterministic=deterministic,
    )
    engine = make_engine(llama_dir, config)
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = engine.generate(PROMPTS, sampling)
    cfg = load_model_config(llama_dir)
    limit = cfg.output_vocab_size or cfg.vocab_size
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == hf_greedy(hf_llama, prompt, NEW_TOKENS, limit)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_trainer_logprobs_agree_with_the_engine(llama_dir: Path, deterministic: bool) -> None:
    config = EngineConfig(
        num_blocks=64, max_model_len=256, max_num_batched_tokens=512, deterministic=deterministic
    )
    engine = make_engine(llama_dir, config)
    sampling = SamplingParams(temperature=0.8, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = engine.generate(PROMPTS, sampling)
    cfg = load_model_config(llama_dir)
    model = build_trainable_model(cfg, load_safetensors(llama_dir), deterministic=deterministic)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied stays tied
    seqs = [p + r.token_ids for p, r in zip(PROMPTS, results, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        trainer = token_logprobs(model, ids, mask, temperature=0.8)
    for i, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
        start = len(prompt) - 1
        ours = trainer[i, start : start + NEW_TOKENS]
        engine_lp = torch.tensor(result.logprobs)
        if deterministic:
            assert torch.equal(ours, engine_lp)  # bitwise
        else:
            torch.testing.assert_close(ours, engine_lp, atol=1e-4, rtol=0)


def test_llama_options_the_decoder_cannot_reproduce_are_refused(llama_dir: Path) -> None:
    base = json.loads((llama_dir / "config.json").read_text())
    from model.config import ModelConfig

    for change, message in (
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3'"),
        ({"model_type": "mistral"}, "unsupported model_type 'mistral'"),
    ):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict({**base, **change})
    no_theta = {k: v for k, v in base.items() if k != "rope_theta"}
    assert ModelConfig.from_dict(no_theta).rope_theta == 10_000.0  # LlamaConfig's default
