"""TRL-shaped reward functions (``workloads.rewards``): called with lists of one in TRL's
conversational format and the task's columns, combined as TRL combines ``reward_funcs``
(weighted sum over the functions that apply), every failure a typed ``RewardFailed``; and the
trainer's side: a sample whose reward failed gets no advantage and leaves its group's
statistics, while with none failed the advantages are TRL's bit for bit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from common.errors import InvalidRequest, RewardFailed
from schemas.reward import RewardRequest
from services.controller.reward_service import reward_request
from services.trainer.core import group_advantages
from workloads import ResponseText, SandboxHandle, load_workload
from workloads.rewards import (
    RewardFunctions,
    check_weights,
    combine,
    declared_rewards,
    load_reward_functions,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"


@pytest.fixture
def capitals(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return load_workload("belayer_example_tasks:make")


def _scored(workload, specs, weights, task, text):
    rewarded = RewardFunctions(
        workload, load_reward_functions(specs), check_weights(specs, weights)
    )
    return asyncio.run(rewarded.reward(task, text))


def test_trl_combination() -> None:
    assert combine([1.0, 0.5], [1.0, 2.0]) == 2.0
    assert combine([None, 0.5], [1.0, 2.0]) == 1.0  # None: not applicable, left out (nansum)
    assert combine([None, None], [1.0, 1.0]) is None
    assert check_weights(["a:b", "c:d"], []) == [1.0, 1.0]
    with pytest.raises(InvalidRequest, match="one reward weight per reward function"):
        check_weights(["a:b"], [1.0, 2.0])


def test_functions_get_the_conversation_and_the_columns(capitals) -> None:
    task = capitals.tasks(1, seed=0)[0]
    word = task.metadata["word"]
    right = f"Answer: {word.upper()}"
    assert _scored(capitals, ["belayer_example_rewards:exact"], [], task, right) == 1.0
    assert _scored(capitals, ["belayer_example_rewards:exact"], [], task, f"Answer: {word}") == 0.0
    both = _scored(capitals, ["belayer_example_rewards:exact", "belayer_example_rewards:brevity"],
                   [1.0, 0.5], task, right)  # fmt: skip
    assert both == pytest.approx(1.0 + 0.5 * (1 - len(right) / 100))


def test_a_failing_function_is_a_typed_reward_failure(capitals) -> None:
    task = capitals.tasks(1, seed=0)[0]
    with pytest.raises(RewardFailed, match="the reward function raised") as info:
        _scored(capitals, ["belayer_example_rewards:broken"], [], task, "Answer: X")
    assert info.value.data["function"] == "belayer_example_rewards:broken"
    assert "broken on purpose" in info.value.data["error"]
    consonant = next(t for t in capitals.tasks(40, seed=1) if t.metadata["word"][0] not in "aeiou")
    with pytest.raises(RewardFailed, match="no reward function applies"):
        _scored(capitals, ["belayer_example_rewards:vowels_only"], [], consonant, "Answer: X")


def test_group_advantages_leave_failed_rewards_out() -> None:
    r = [1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 1.0, 0.0]
    plain = group_advantages(r, 4)
    assert torch.equal(group_advantages(r, 4, valid=[True] * 8), plain)  # TRL's, bit for bit
    masked = group_advantages(r, 4, valid=[True, True, False, True, True, True, True, True])
    assert masked[2] == 0.0
    assert torch.allclose(masked[:2], group_advantages([1.0, 0.0, 0.25], 3)[:2])
    assert masked[3] == group_advantages([1.0, 0.0, 0.25], 3)[2]
    assert torch.equal(masked[4:], plain[4:])  # the other group is untouched
    alone = group_advantages(r, 4, valid=[False, False, False, False, True, True, True, True])
    assert torch.equal(alone[:4], torch.zeros(4))


def test_a_reward_service_is_asked_with_the_token_ids_and_the_sandbox(capitals) -> None:
    task = capitals.tasks(1, seed=0)[0]
    asked: list[RewardRequest] = []

    async def ask(name: str, t, outcome) -> float:
        asked.append(reward_request(t, outcome))
        return 0.5

    scored = RewardFunctions(capitals, load_reward_functions(["service:judge"]), [1.0], ask)
    text = ResponseText("Answer: X", token_ids=[7, 8, 2], trajectory_id="r1-s0-a0")
    assert isinstance(text, str) and text == "Answer: X"  # a plain str to every workload
    assert asyncio.run(scored.reward(task, text)) == 0.5
    req = asked[-1]
    assert (req.response, req.response_token_ids) == ("Answer: X", [7, 8, 2])
    assert (req.trajectory_id, req.sandbox_id, req.task_id) == ("r1-s0-a0", "", task.id)
    assert reward_request(task, "Answer: X").response_token_ids == []  # a plain str: text only

    handle = SandboxHandle(ops=None, sandbox_id="sb-1", trajectory_id="r1-s1-a0",  # type: ignore[arg-type]  # ops=None: never used here
                           response="done", token_ids=(5,))  # fmt: skip
    assert asyncio.run(scored.reward(task, handle)) == 0.5  # services score sandbox tasks
    assert (asked[-1].sandbox_id, asked[-1].response_token_ids) == ("sb-1", [5])
    functions = RewardFunctions(
        capitals, load_reward_functions(["belayer_example_rewards:exact"]), [1.0], ask
    )
    with pytest.raises(InvalidRequest, match="reward services only"):
        asyncio.run(functions.reward(task, handle))


def test_a_workload_declares_its_reward_services() -> None:
    class Declared:
        name = "declared"
        rewards = ["service:judge"]

    assert declared_rewards(Declared()) == ["service:judge"]
    assert declared_rewards(object()) == []
    for bad in (["belayer_example_rewards:exact"], "service:judge", [1]):
        Declared.rewards = bad  # type: ignore[assignment]  # ill-typed on purpose
        with pytest.raises(InvalidRequest, match="service:<name>"):
            declared_rewards(Declared())
