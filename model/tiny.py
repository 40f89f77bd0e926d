"""Write a tiny, randomly initialised Qwen3 (or Llama) model directory for tests, demos and
benchmarks.

The directory looks like a Hugging Face checkpoint (``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``) so both
transformers and our own loaders read it, fully offline. The tokenizer is a byte-level BPE
trained in well under a second on a small built-in English and arithmetic corpus.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A climber ties in, checks the knot, and the
belayer watches the rope. When a worker fails, the shadow takes over and the run goes on.
Please answer the question. Think step by step, then give the final answer.
The answer is the number after the equals sign. What is the sum of the two numbers?
We add the ones, carry the tens, and write the result. Reinforcement learning rewards a
policy for good answers. The model reads the prompt, writes a response, and gets a reward.
You are a helpful assistant. The user asks a question and the assistant answers it.
Every request completes exactly once. No token is generated twice and no token is lost.
"""

_WORDS = (
    "the a an one two three four five six seven eight nine ten number sum total answer "
    "question result add plus minus times equals is are was were has have of to in on at "
    "for with and or but if then so because first next last step check rope knot climb "
    "wall route hold safe fall catch model worker shadow router token request reward "
    "train policy agent tool file run test pass fail good bad small large more less"
).split()


def _corpus(seed: int) -> list[str]:
    """A deterministic mix of English sentences and arithmetic with answers."""
    rng = random.Random(seed)
    lines = _ENGLISH.splitlines()
    for _ in range(600):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {value}. The answer is {value}.")
    for _ in range(600):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 14))) + ".")
    for _ in range(100):
        q = " ".join(rng.choice(_WORDS) for _ in range(6))
        lines.append(f"{IM_START}user\n{q}?{IM_END}\n{IM_START}assistant\n{q}.{IM_END}")
    return lines


def train_bpe(corpus: list[str], vocab_size: int, *, split_digits: bool = False) -> Tokenizer:
    """A byte-level BPE with Qwen-style special tokens (ids 0, 1, 2), its merges learnt from
    ``corpus`` (any other text still encodes, byte by byte at worst); ``split_digits``: one
    token per digit, as Qwen's tokenizer does."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def train_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """The tiny model's tokenizer: a byte-level BPE (``train_bpe``) over a synthetic corpus."""
    return train_bpe(_corpus(seed), vocab_size)


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors: normal(0, 0.02) matrices and ones for the norms."""
    gen = torch.Generator().manual_seed(seed)
    hidden, hd = cfg["hidden_size"], cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    out = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal(heads * hd, hidden)
        out[p + "self_attn.k_proj.weight"] = normal(kv_heads * hd, hidden)
        out[p + "self_attn.v_proj.weight"] = normal(kv_heads * hd, hidden)
        out[p + "self_attn.o_proj.weight"] = normal(hidden, heads * hd)
        if cfg["model_type"] == "qwen3":  # Llama has no per-head q/k norms
            out[p + "self_attn.q_norm.weight"] = torch.ones(hd)
            out[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        out[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        out[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        out[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        out[p + "input_layernorm.weight"] = torch.ones(hidden)
        out[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    out["model.norm.weight"] = torch.ones(hidden)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = normal(vocab, hidden)
    return out


def init_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 768,
    vocab_size: int = 4096,
    seed: int = 0,
    model_type: str = "qwen3",
) -> Path:
    """Write a complete tiny Qwen3 model directory to ``out_dir`` and return its path.

    ``model_type="llama"`` writes a tiny Llama instead (as SmolLM2 is built: no q/k norms,
    the output layer tied to the embedding, RoPE base 10000, grouped-query heads), with the
    same tokenizer. Deterministic for a given ``seed``. The tokenizer's vocabulary is at most ``vocab_size``
    (the BPE trainer may stop earlier on the small corpus); the model's embedding always has
    ``vocab_size`` rows.
    """
    if model_type not in ("qwen3", "llama"):
        raise ValueError(f"model_type must be qwen3 or llama, not {model_type!r}")
    llama = model_type == "llama"
    if vocab_size < 512:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size, seed)
    tok.save(str(root / "tokenizer.json"))
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if llama else "Qwen3ForCausalLM"],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0 if llama else 1_000_000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "tie_word_embeddings": llama,
        "torch_dtype": "float32",
        "use_cache": True,
        "initializer_range": 0.02,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
    }
    _write_json(root / "config.json", config)
    _write_generation_files(root, eot, im_end)
    save_file(_random_weights(config, seed), str(root / "model.safetensors"))
    return root


def _write_generation_files(root: Path, eot: int | None, im_end: int | None) -> None:
    """generation_config.json and tokenizer_config.json (with the chat template)."""
    _write_json(
        root / "generation_config.json",
        {
            "bos_token_id": eot,
            "eos_token_id": [im_end, eot],
            "pad_token_id": eot,
            "do_sample": False,
        },
    )
    _write_json(
        root / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "model_max_length": 2048,
            "clean_up_tokenization_spaces": False,
            "chat_template": _CHAT_TEMPLATE,
        },
    )


# Qwen's ChatML layout, without tools or thinking blocks.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
