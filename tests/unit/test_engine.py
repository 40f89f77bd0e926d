"""LLMEngine end to end on a small random model: resume, batch invariance, lifecycle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.config import load_model_config
from model.loader import load_safetensors
from model.qwen3 import kv_cache_shape
from services.worker.engine.config import EngineConfig
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sequence import SamplingParams
from tests.unit.model_fixtures import make_engine, write_small_model

torch.set_num_threads(1)

N, M = 24, 9
PROMPT = [5, 17, 301, 42, 7, 99, 123]
OTHERS = [[3] * 5, list(range(20, 60)), [400, 401]]
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=N, ignore_eos=True),
}


def generate_one(
    engine: LLMEngine, prompt: list[int], sampling: SamplingParams, offset: int = 0
) -> list[int]:
    engine.add_request("one", prompt, sampling, generated_offset=offset)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_model(tmp_path_factory.mktemp("small-model"))


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_resume_on_a_new_engine_continues_exactly(small_model_dir: Path, kind: str) -> None:
    sampling = SAMPLINGS[kind]
    full = generate_one(make_engine(small_model_dir), PROMPT, sampling)
    assert len(full) == N
    rest = SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        max_tokens=N - M,
        ignore_eos=True,
    )
    # A fresh engine (fresh KV, another unseeded stream) gets the prompt plus M tokens.
    resumed = generate_one(
        make_engine(small_model_dir, sampler_seed=77), PROMPT + full[:M], rest, offset=M
    )
    assert resumed == full[M:]


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_batch_invariance(small_model_dir: Path, kind: str) -> None:
    sampling = SAMPLINGS[kind]
    alone = make_engine(small_model_dir).generate([PROMPT], sampling)[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=N)  # unseeded neighbours
    batch = make_engine(small_model_dir).generate(
        [OTHERS[0], PROMPT, *OTHERS[1:]], [noisy, sampling, noisy, noisy]
    )
    assert batch[1].token_ids == alone


def test_preemption_recomputes_without_changing_greedy_output(small_model_dir: Path) -> None:
    prompts = [[i + 1] * 10 for i in range(4)]
    sampling = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = make_engine(small_model_dir).generate(prompts, sampling)
    tight_config = EngineConfig(
        block_size=4, num_blocks=24, max_model_len=64, max_num_batched_tokens=256
    )
    tight = make_engine(small_model_dir, tight_config)
    results = tight.generate(prompts, sampling)
    assert tight.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
    assert tight.scheduler.block_manager.num_free_blocks == 24


def test_step_outputs_and_abort(small_model_dir: Path) -> None:
    engine = make_engine(small_model_dir)
    sampling = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", PROMPT, sampling)
    engine.add_request("b", OTHERS[1], sampling)
    assert engine.num_waiting == 2
    first = engine.step()
    assert [o.request_id for o in first] == ["a", "b"]
    assert all(len(o.new_token_ids) == 1 and len(o.new_logprobs) == 1 for o in first)
    assert all(lp <= 0 for o in first for lp in o.new_logprobs)
    assert engine.num_running == 2 and engine.num_waiting == 0
    assert engine.abort_request("b")
    assert not engine.abort_request("b")
    out = engine.step()
    assert out[0].request_id == "b" and out[0].finished and out[0].finish_reason == "abort"
    assert [o.request_id for o in out[1:]] == ["a"] and engine.num_running == 1
    engine.add_request("b", PROMPT, sampling)  # the id is free again once finished


def test_finishes_on_eos_unless_ignored(small_model_dir: Path) -> None:
    sampling = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = make_engine(small_model_dir).generate([PROMPT], sampling)[0].token_ids
    eos = tokens[3]
    first = tokens.index(eos)
    engine = make_engine(small_model_dir, eos_token_ids=(eos,))
    stopped = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0]
    assert stopped.token_ids == tokens[: first + 1] and stopped.finish_reason == "stop"
    ignored = engine.generate([PROMPT], sampling)[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_rejects_bad_requests_and_caches(small_model_dir: Path) -> None:
    engine = make_engine(small_model_dir)
    engine.add_request("dup", PROMPT, SamplingParams())
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("dup", PROMPT, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [1] * 256, SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.add_request("vocab", [10_000], SamplingParams())
    cfg = load_model_config(small_model_dir)
    bad_kv = torch.zeros(kv_cache_shape(cfg, 8, 16))
    with pytest.raises(ValueError, match="kv_cache shape"):
        LLMEngine(cfg, load_safetensors(small_model_dir), bad_kv, EngineConfig())


def test_warmup_leaves_the_shared_cache_untouched(small_model_dir: Path) -> None:
    engine = make_engine(small_model_dir)
    engine.warmup()
    assert not engine.runner.kv_cache.any()
    assert not engine.has_unfinished()
