"""Scoring through the real path: a running node (real NATS, router, worker, controller) with
the warm-started math model. What the router returns as ``text`` holds no special token while
``token_ids`` keep the end-of-sequence id; no sampled id lies outside the tokenizer; and the
controller scores a correct answer 1.0 and a wrong one reasoning-gym's own value for it
(computed here from the checker itself, not from Belayer's scoring code)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym

from model.chat import ChatFormat
from model.tokenizer import load_tokenizer
from schemas.rollout import RolloutRequest
from schemas.serving import GenerateRequest, SamplingParams
from services.controller.client import submit, trajectories, wait
from services.router.client import generate
from tests.integration.node_helpers import Node, start_node, stop_node
from workloads import AnswerCheck, load_workload, parse_answer

pytestmark = pytest.mark.timeout(400)

TASKS = 24
"""Training problems rolled out (× ``N`` samples): enough that both correct and wrong answers
occur with a model whose sampled pass@1 is between 0.15 and 0.6."""
N = 2


@pytest.fixture(scope="module")
def math_node(
    warm_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Node, Path]]:
    model_dir = warm_model("math")
    node = start_node(tmp_path_factory.mktemp("scoring"), "--model", str(model_dir))
    try:
        yield node, model_dir
    finally:
        stop_node(node)


def checker_value(check: AnswerCheck, answer: str) -> float:
    """reasoning-gym's score of ``answer`` for the task's entry, straight from its dataset."""
    entry = json.loads(check.entry_json)
    return float(
        reasoning_gym.create_dataset(check.dataset, size=1, seed=0).score_answer(answer, entry)
    )


async def test_router_text_is_what_the_model_meant(math_node: tuple[Node, Path]) -> None:
    node, model_dir = math_node
    tok = load_tokenizer(model_dir)
    chat = ChatFormat(tok)
    task = load_workload("math").held_out(1)[0]
    nc = await node.connect("test-scoring")
    try:
        prompt = chat.prompt((m.role, m.content) for m in task.prompt)
        req = GenerateRequest(
            request_id="scoring-text", prompt_token_ids=prompt,
            sampling=SamplingParams(temperature=0.0, max_tokens=64), stream=False,
        )  # fmt: skip
        result = await generate(nc, req, timeout=60.0)
    finally:
        await nc.drain()
    assert result.finish_reason == "stop" and result.token_ids[-1] in tok.eos_token_ids
    assert result.text == tok.text(result.token_ids)
    assert "<|im_end|>" not in result.text and "<|" not in result.text
    assert tok.decode(result.token_ids).endswith("<|im_end|>")  # the ids keep the EOS


async def test_a_correct_answer_scores_one_through_the_controller(
    math_node: tuple[Node, Path],
) -> None:
    node, model_dir = math_node
    tok = load_tokenizer(model_dir)
    wl = load_workload("math")
    tasks = wl.tasks(TASKS, seed=3)
    nc = await node.connect("test-scoring")
    try:
        req = RolloutRequest(
            workload="math", rollout_id="scoring-path", task_ids=[t.id for t in tasks], n=N,
            sampling=SamplingParams(temperature=1.0, max_tokens=64), seed=11,
        )  # fmt: skip
        await submit(nc, req)
        result = await wait(nc, "scoring-path", timeout=300)
        assert result.summary.trajectories_completed == TASKS * N
        records = await trajectories(nc, "scoring-path")
    finally:
        await nc.drain()
    assert len(records) == TASKS * N
    by_id = {t.id: t for t in tasks}
    limit = tok.id_limit
    correct = wrong = 0
    for t in records:
        assert all(0 <= i < limit for i in t.response_ids), "a sampled id has no token"
        task = by_id[t.task_id]
        assert isinstance(task.reward, AnswerCheck)
        answer = parse_answer(tok.text(t.response_ids))
        if answer is None:
            assert t.reward == 0.0
        elif answer == task.reference_answer:
            assert t.reward == 1.0, (t.trajectory_id, answer)
            correct += 1
        else:
            assert t.reward == pytest.approx(checker_value(task.reward, answer)), answer
            assert t.reward < 1.0
            wrong += 1
    # The warm-started model solves some but not all: both cases were exercised.
    assert correct >= 1 and wrong >= 1, (correct, wrong)
