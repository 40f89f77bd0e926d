"""Decode throughput of the engine alone (no bus), for the ``belayer bench`` CLI."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from model.config import load_model_config
from model.loader import load_safetensors
from model.qwen3 import kv_cache_shape
from services.worker.engine.config import EngineConfig
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sequence import SamplingParams

PROMPT_LEN = 16


def bench_engine(
    model_dir: str | Path,
    batch_sizes: tuple[int, ...] = (1, 8),
    new_tokens: int = 128,
    *,
    num_threads: int | None = 1,
) -> dict[int, float]:
    """Generated tokens per second for each batch size (greedy, ``ignore_eos``).

    Each batch holds ``batch_size`` prompts of 16 tokens generating ``new_tokens`` each; the
    time includes the prefill step. ``num_threads`` (default 1, as on the 2-core CI machine)
    is set for the run and restored after; None leaves torch's setting alone.
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        model_config = load_model_config(model_dir)
        params = load_safetensors(model_dir)
        max_batch = max(batch_sizes)
        config = EngineConfig(
            max_num_seqs=max(16, max_batch),
            block_size=16,
            num_blocks=max_batch * (-(-(PROMPT_LEN + new_tokens) // 16)) + 1,
            max_model_len=PROMPT_LEN + new_tokens + 1,
            max_num_batched_tokens=max(4096, PROMPT_LEN * max_batch),
        )
        kv_cache = torch.zeros(
            kv_cache_shape(model_config, config.num_blocks, config.block_size),
            dtype=model_config.dtype,
        )
        engine = LLMEngine(model_config, params, kv_cache, config)
        engine.warmup()
        sampling = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        results: dict[int, float] = {}
        for batch in batch_sizes:
            vocab = model_config.vocab_size
            prompts = [
                [(7 * i + 13 * j + 1) % vocab for j in range(PROMPT_LEN)] for i in range(batch)
            ]
            start = time.perf_counter()
            outputs = engine.generate(prompts, sampling)
            elapsed = time.perf_counter() - start
            results[batch] = sum(len(o.token_ids) for o in outputs) / elapsed
        return results
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    import sys

    print(bench_engine(sys.argv[1]))
