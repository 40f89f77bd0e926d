"""The model hyper-parameters Belayer needs, read from a Hugging Face ``config.json``.

Two families of dense causal LMs are supported, each a ``model_type`` of :data:`FAMILIES`:
``qwen3`` (per-head q/k RMSNorm) and ``llama`` (none; SmolLM2, TinyLlama, Llama 2 and other
``LlamaForCausalLM`` checkpoints without RoPE scaling). Both run on the one decoder of :mod:`model.qwen3`; the
config decides what differs (q/k norm, RoPE base, tied embeddings, grouped-query heads).
Anything that decoder cannot reproduce exactly (RoPE scaling, sliding windows, attention or
MLP biases, another activation) is refused here with a ``ValueError`` instead of silently
producing different logits.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only when a dtype is asked for (a config alone needs none)
    import torch


@dataclass(frozen=True)
class ModelFamily:
    """What one architecture family changes in the shared decoder."""

    qk_norm: bool
    """Per-head RMSNorm of q and k before RoPE (Qwen3) or none (Llama)."""
    default_rope_theta: float
    """RoPE base when ``config.json`` names none (the HF config class's default)."""


FAMILIES: dict[str, ModelFamily] = {
    "qwen3": ModelFamily(qk_norm=True, default_rope_theta=1_000_000.0),
    "llama": ModelFamily(qk_norm=False, default_rope_theta=10_000.0),
}
"""``model_type`` → family: the architectures Belayer serves and trains."""

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

DTYPE_NAMES = ("float32", "float16", "bfloat16")
"""``torch_dtype`` values Belayer reads (each the name of a ``torch`` dtype)."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Qwen3 or Llama causal LM (names follow the HF ``config.json``)."""

    vocab_size: int
    """Rows of the embedding and of the output layer."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SiLU-gated MLP."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (grouped-query attention when fewer than query heads)."""
    head_dim: int
    """Width of one attention head (Qwen3 sets it explicitly; else hidden/heads)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary position embedding."""
    max_position_embeddings: int = 32768
    """Longest position the rotary tables cover."""
    tie_word_embeddings: bool = False
    """When true the output layer reuses ``model.embed_tokens.weight``."""
    torch_dtype: str = "float32"
    """Dtype the checkpoint is stored in (``float32``, ``bfloat16`` or ``float16``)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if the model defines one."""
    eos_token_id: tuple[int, ...] = ()
    """End-of-sequence tokens (HF allows an int or a list; always a tuple here)."""
    model_type: str = "qwen3"
    """HF model type: a key of :data:`FAMILIES` (``qwen3`` or ``llama``)."""
    output_vocab_size: int = 0
    """Ids the model may emit: one past the tokenizer's largest id when the output layer has
    more rows than the tokenizer has tokens (padding rows, as in the tiny models and Qwen3).
    :meth:`~model.qwen3.Qwen3ForCausalLM.compute_logits` masks the rows beyond it to −inf, as
    serving engines do, so no sampled id lacks a token. 0: every row (no tokenizer found)."""

    @property
    def dtype(self) -> torch.dtype:
        """``torch_dtype`` as a :class:`torch.dtype`."""
        import torch

        dtype: torch.dtype = getattr(torch, self.torch_dtype)
        return dtype

    @property
    def family(self) -> ModelFamily:
        """The architecture family of ``model_type``."""
        return FAMILIES[self.model_type]

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed JSON of a HF ``config.json``; refuse what we cannot run."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: Belayer's engine runs only "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} models"
            )
        _refuse_unsupported_features(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        # transformers 5 writes "dtype" and nests rope_theta in rope_parameters; 4.x did not.
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
        if dtype not in DTYPE_NAMES:
            raise ValueError(
                f"unsupported torch_dtype {dtype!r}; expected one of {list(DTYPE_NAMES)}"
            )
        rope = raw.get("rope_parameters") or {}
        default_theta = FAMILIES[str(model_type)].default_rope_theta
        cfg = cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", default_theta))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=token_ids(raw.get("eos_token_id")),
            model_type=str(model_type),
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        return cfg


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``<model_dir>/config.json`` into a :class:`ModelConfig`; with a ``tokenizer.json``
    beside it, ``output_vocab_size`` is the tokenizer's id range."""
    path = Path(model_dir) / "config.json"
    with path.open() as f:
        cfg = ModelConfig.from_dict(json.load(f))
    if (Path(model_dir) / "tokenizer.json").is_file():
        from model.tokenizer import load_tokenizer  # a light import (no transformers)

        limit = load_tokenizer(model_dir).id_limit
        if 0 < limit < cfg.vocab_size:
            cfg = dataclasses.replace(cfg, output_vocab_size=limit)
    return cfg


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A config's token id field (``eos_token_id``: one id, a list or none) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _refuse_unsupported_features(raw: dict[str, Any]) -> None:
    """Raise on HF options that would change the maths of the plain Qwen3/Llama forward."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported RoPE scaling {rope_type!r}; only default RoPE is supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; expected 'silu'")
    if raw.get("attention_bias", False):
        raise ValueError("attention_bias=true is not supported")
    if raw.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported")
    if int(raw.get("pretraining_tp") or 1) != 1:
        raise ValueError(f"pretraining_tp={raw['pretraining_tp']} is not supported (only 1)")
    if raw.get("use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of the paged KV cache: ``[layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]``.

    The arena must start finite (zeros): padded block-table entries and the unused tail of a
    sequence's last block are read and masked out, and a NaN there would survive the mask.
    """
    return (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
