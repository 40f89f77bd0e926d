"""The Qwen3 model Belayer serves and trains: config, weights, tokenizer, paged-KV forward
and the dense training forward."""

from model.config import ModelConfig, load_model_config
from model.loader import load_safetensors
from model.qwen3 import AttentionMetadata, Qwen3ForCausalLM, build_model, kv_cache_shape
from model.tokenizer import Tokenizer, load_tokenizer
from model.train_forward import build_trainable_model, dense_forward, token_logprobs

__all__ = [
    "AttentionMetadata",
    "ModelConfig",
    "Qwen3ForCausalLM",
    "Tokenizer",
    "build_model",
    "build_trainable_model",
    "dense_forward",
    "kv_cache_shape",
    "load_model_config",
    "load_safetensors",
    "load_tokenizer",
    "token_logprobs",
]
