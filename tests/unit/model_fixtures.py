"""Helpers shared by the model and engine tests: tiny model directories and engines."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

import torch

from model.config import ModelConfig, load_model_config
from model.loader import load_safetensors
from model.qwen3 import kv_cache_shape
from model.tiny import init_tiny_model
from services.worker.engine.config import EngineConfig
from services.worker.engine.llm_engine import LLMEngine


class ModelShape(TypedDict):
    """A tiny model's shape, as ``init_tiny_model`` takes it (typed, so ``**shape`` checks)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


# Smaller than the default tiny model: engine tests care about bookkeeping, not size.
SMALL_MODEL: ModelShape = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
}


def write_small_model(out_dir: Path) -> Path:
    """A small random Qwen3 directory (see ``SMALL_MODEL``)."""
    return init_tiny_model(out_dir, **SMALL_MODEL, seed=1)


def make_engine(
    model_dir: Path,
    config: EngineConfig | None = None,
    *,
    eos_token_ids: tuple[int, ...] | None = None,
    sampler_seed: int | None = None,
) -> LLMEngine:
    """An engine over ``model_dir`` with its own zeroed KV cache."""
    config = config or EngineConfig(num_blocks=64, max_model_len=256, max_num_batched_tokens=1024)
    model_config: ModelConfig = load_model_config(model_dir)
    kv = torch.zeros(kv_cache_shape(model_config, config.num_blocks, config.block_size))
    return LLMEngine(
        model_config,
        load_safetensors(model_dir),
        kv,
        config,
        eos_token_ids=eos_token_ids,
        sampler_seed=sampler_seed,
    )
