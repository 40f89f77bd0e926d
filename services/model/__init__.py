"""The Qwen3 model Belayer serves and trains: config, weights, tokenizer, paged-KV forward."""

from services.model.config import ModelConfig, load_model_config
from services.model.loader import load_safetensors
from services.model.qwen3 import AttentionMetadata, Qwen3ForCausalLM, build_model, kv_cache_shape
from services.model.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "AttentionMetadata",
    "ModelConfig",
    "Qwen3ForCausalLM",
    "Tokenizer",
    "build_model",
    "kv_cache_shape",
    "load_model_config",
    "load_safetensors",
    "load_tokenizer",
]
