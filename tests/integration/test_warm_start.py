"""``belayer model init --tiny --warm-start math|swe DIR`` for real: the CLI trains (or copies
from its cache) a model that, sampled at temperature 1 through the in-process engine in the
controller's chat layout, answers held-out math problems in the convention and solves some of
them; the SWE demonstrations are recorded in real sandboxes (real dockerd) and the SWE model's
own actions, executed in real sandboxes, follow the demonstrated recipe on new instances. A second init with the same
inputs is a copy, not a training."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from model.config import load_model_config
from model.loader import load_safetensors
from model.tokenizer import load_tokenizer
from model.warm_start import STAMP_FILE, demonstrations_digest, read_stamp
from services.cli.model_cmd import evaluate_math, evaluate_swe
from services.environment.client import with_private_env
from services.rl.demonstrations import (
    SWE_DEMO_PER_FAMILY,
    SWE_VARIANTS,
    cache_root,
    plain_variants,
    record_swe,
    swe_demonstrations,
    swe_variant,
)
from tests.model_fixtures import warm_start_cli
from workloads import BashAction, SubmitAction, load_workload, parse_action
from workloads.swe_families import TRAIN_FAMILIES

pytestmark = [pytest.mark.slow]


def _loads(model_dir: Path) -> None:
    config = load_model_config(model_dir)
    tensors = load_safetensors(model_dir)
    assert tensors["model.embed_tokens.weight"].shape[0] == config.vocab_size
    im_end = load_tokenizer(model_dir).token_to_id("<|im_end|>")
    assert im_end in config.eos_token_id  # a chat response ends the request


@pytest.mark.timeout(2700)
def test_math_warm_start_answers_in_the_convention_and_solves_some(
    warm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = warm_model("math")
    _loads(model_dir)
    stamp = read_stamp(model_dir)
    assert stamp is not None and stamp["kind"] == "math"
    assert stamp["final_loss"] < 0.5 * stamp["first_loss"], stamp

    sampled = evaluate_math(model_dir, 128, temperature=1.0, seed=1)
    assert sampled.parse_rate > 0.5, sampled.as_dict()
    # A policy GRPO can improve: a group of 8 samples usually holds a right and a wrong answer
    # (docs/training.md; the recipe measured 0.48).
    assert 0.15 <= sampled.solved / sampled.episodes <= 0.6, sampled.as_dict()
    greedy = evaluate_math(model_dir, 64, temperature=0.0)
    assert greedy.parse_rate > 0.8, greedy.as_dict()

    # Same inputs again: the cached directory is copied (no training), byte for byte.
    t0 = time.perf_counter()
    again = warm_start_cli("math", tmp_path / "again")
    assert again.returncode == 0, again.stderr
    assert "from the cache" in again.stdout and time.perf_counter() - t0 < 60
    for name in ("model.safetensors", "tokenizer.json", "config.json", STAMP_FILE):
        assert (tmp_path / "again" / name).read_bytes() == (model_dir / name).read_bytes()


@pytest.mark.docker
@pytest.mark.timeout(1500)
def test_swe_warm_start_is_built_from_real_sandbox_observations_and_acts(
    warm_model: Callable[[str], Path],
) -> None:
    model_dir = warm_model("swe")
    _loads(model_dir)
    stamp = read_stamp(model_dir)
    assert stamp is not None and stamp["kind"] == "swe"

    # The demonstrations it was trained on are the cached recording …
    cached = swe_demonstrations(cache_root())
    assert demonstrations_digest(cached) == stamp["demonstrations_digest"]
    assert len(cached) == SWE_DEMO_PER_FAMILY * len(TRAIN_FAMILIES)
    assert 0.3 < sum(d.variant == "named" for d in cached) / len(cached) < 0.7
    # … and recording the first instance of each family again in fresh real sandboxes gives
    # exactly the same transcripts: the observations are what the sandbox really printed, with
    # no clock in them (the same command in the same state reads the same).
    swe = load_workload("swe", check_image=False)
    tasks = [swe.task(d.task_id) for d in cached]
    first = {
        t.metadata["family"]: (t, d) for t, d in reversed(list(zip(tasks, cached, strict=True)))
    }
    tasks = [t for t, _d in first.values()]
    fresh = asyncio.run(
        with_private_env(lambda ops: record_swe(ops, tasks, plain_variants(), pick=swe_variant))
    )
    assert [(d.task_id, d.variant, d.messages) for d in fresh] == [
        (d.task_id, d.variant, d.messages) for _t, d in first.values()
    ]
    # Generated training instances of every training family, never a held-out one; each the
    # general recipe, with names or without: the failing test run, the module, the fix, the
    # passing run, submit.
    assert {t.metadata["split"] for t in tasks} == {"train"}
    assert set(first) == set(TRAIN_FAMILIES)
    for demo, task in zip(fresh, tasks, strict=True):
        replies = [c for r, c in demo.messages if r == "assistant"]
        assert demo.variant == swe_variant(task)
        assert [parse_action(r) for r in replies] == [
            BashAction(a) for a in SWE_VARIANTS[demo.variant][0](task)
        ] + [SubmitAction()]
        seen = [c for r, c in demo.messages[len(task.prompt) :] if r == "user"]
        assert seen[0].startswith("exit_code: 1") and "1 failed" in seen[0]
        assert " in 0." not in seen[0] and " in 0." not in seen[3]  # pytest's clock dropped
        assert seen[1] == "exit_code: 0\n" + task.sandbox.files[task.metadata["module"]].decode()  # type: ignore[union-attr]  # SWE: has a sandbox
        assert (
            seen[2] == "exit_code: 0" and seen[3].startswith("exit_code: 0") and "passed" in seen[3]
        )

    # Real episodes on training instances it never saw (another seed): the model's own
    # sampled actions run in real sandboxes.
    report = evaluate_swe(model_dir, 1, temperature=1.0, seed=0)
    print(json.dumps(report.as_dict()))
    assert report.parse_rate > 0.5, report.as_dict()
    # It follows the recipe (the tests first, the modules read, then an edit, with names or
    # without); which edit works on instances it never saw is what GRPO is for
    # (docs/training.md). Sampled at T = 1 it edits in every episode and writes the name-free
    # fix in about 4 of 10 (the share of its demonstrations): none of 11 would miss a model
    # with that rate about once in 300 builds, and catches one that lost either way.
    assert all(a[0] == "python3 -m pytest -q" for a in report.actions), report.actions
    named = sum(any(x.startswith("sed -i 's/") for x in a) for a in report.actions)
    pattern = sum(
        any(x.startswith("find . -name '*.py' -exec sed") for x in a) for a in report.actions
    )
    assert named >= 1 and pattern >= 1 and 4 * (named + pattern) > len(report.actions), (
        report.actions
    )
