"""Our paged-KV Qwen3 against Hugging Face transformers on the same tiny checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from model.config import load_model_config
from model.loader import load_safetensors
from model.qwen3 import AttentionMetadata, build_model, kv_cache_shape
from model.tiny import init_tiny_model
from model.tokenizer import load_tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.sequence import SamplingParams
from tests.unit.model_fixtures import make_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (hidden 256, 4 layers, GQA 4:2, vocab 4096)."""
    return init_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model: Any, prompt: list[int], n: int, limit: int) -> list[int]:
    """Reference: argmax over a full forward of the whole sequence, n times (no HF cache),
    among the ``limit`` ids the tokenizer has (HF's ``suppress_tokens`` for the padding rows,
    which our engine masks as serving engines do)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids])).logits[0, -1, :limit]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_transformers_reads_our_config_and_tokenizer(model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(model_dir).model_type == "qwen3"
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    ours = load_tokenizer(model_dir)
    text = "What is 12 + 7? The answer is 19.<|im_end|>"
    ids = ours.encode(text)
    assert hf_tok.encode(text, add_special_tokens=False) == ids
    assert ours.decode(ids) == text == hf_tok.decode(ids)
    assert ours.vocab_size <= load_model_config(model_dir).vocab_size
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
    chat = hf_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_logits_match_transformers(model_dir: Path, hf_model: Any) -> None:
    cfg = load_model_config(model_dir)
    model = build_model(cfg, load_safetensors(model_dir))
    block_size, num_blocks = 8, 8
    kv = torch.zeros(kv_cache_shape(cfg, num_blocks, block_size))
    prompt = [(5 * i + 3) % 2000 for i in range(21)]
    # Blocks deliberately out of order: position p lives in table[p // 8].
    table = [5, 2, 7, 0]
    slots = torch.tensor(
        [table[p // block_size] * block_size + p % block_size for p in range(len(prompt) + 1)]
    )
    with torch.inference_mode():
        attn = AttentionMetadata.prefill(slots[:-1], [len(prompt)])
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), attn, kv)
        ours = model.compute_logits(hidden)
        nxt = int(ours[-1].argmax())
        attn = AttentionMetadata.decode(
            slots[-1:], torch.tensor([table[:3]]), torch.tensor([len(prompt) + 1]), block_size
        )
        hidden = model(torch.tensor([nxt]), torch.tensor([len(prompt)]), attn, kv)
        ours_decode = model.compute_logits(hidden)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([[*prompt, nxt]])).logits[0]
    # The output layer has padding rows past the tokenizer: masked to -inf, the rest as HF's.
    limit = cfg.output_vocab_size
    assert 0 < limit == load_tokenizer(model_dir).vocab_size < cfg.vocab_size
    assert torch.isneginf(ours[:, limit:]).all() and torch.isneginf(ours_decode[limit:]).all()
    torch.testing.assert_close(ours[:, :limit], ref[:-1, :limit], atol=1e-4, rtol=0)
    torch.testing.assert_close(ours_decode[:limit], ref[-1, :limit], atol=1e-4, rtol=0)


def test_batched_paged_greedy_matches_transformers_token_for_token(
    model_dir: Path, hf_model: Any
) -> None:
    # Different lengths in one batch; block_size 8 makes every sequence cross blocks.
    config = EngineConfig(
        block_size=8, num_blocks=64, max_model_len=256, max_num_batched_tokens=512
    )
    engine = make_engine(model_dir, config)
    prompts = [
        [17],
        [(11 * i + 1) % 4096 for i in range(7)],
        [(13 * i + 5) % 4096 for i in range(16)],
        [(7 * i + 2) % 4096 for i in range(33)],
    ]
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = engine.generate(prompts, sampling)
    limit = load_model_config(model_dir).output_vocab_size
    for prompt, result in zip(prompts, results, strict=True):
        assert result.finish_reason == "length"
        assert result.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS, limit)


def test_build_model_is_zero_copy_and_ties_embeddings(tmp_path: Path) -> None:
    model_dir = init_tiny_model(
        tmp_path, hidden_size=64, num_layers=1, head_dim=16, intermediate_size=64, vocab_size=512
    )
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (model_dir / "config.json").write_text(json.dumps(config))
    cfg = load_model_config(model_dir)
    tensors = load_safetensors(model_dir)
    tensors.pop("lm_head.weight")
    model = build_model(cfg, tensors)
    params = dict(model.named_parameters())
    for name, tensor in tensors.items():
        assert params[name].data_ptr() == tensor.data_ptr(), name
    assert model.lm_head.weight.data_ptr() == tensors["model.embed_tokens.weight"].data_ptr()
    assert not any(p.requires_grad for p in model.parameters())
    tensors.pop("model.norm.weight")
    with pytest.raises(ValueError, match=r"missing=\['model.norm.weight'\]"):
        build_model(cfg, tensors)


def test_load_safetensors_from_shards(tmp_path: Path) -> None:
    model_dir = init_tiny_model(
        tmp_path / "single",
        hidden_size=64,
        num_layers=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=512,
    )
    tensors = load_safetensors(model_dir)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_safetensors(sharded)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[n], tensors[n]) for n in names)


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model_config(tmp_path)
