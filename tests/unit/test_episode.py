"""One episode: ``workloads.episode`` is the agent loop every user of an episode drives — the
controller's trajectories (``TrajectoryCore`` is an ``Episode`` plus checkpoints), the held-out
evaluation and ``belayer model eval`` (``play``). The same responses give the same context,
observations, mask and score in both, and the limits are declared once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from model.chat import ChatFormat
from model.tokenizer import Tokenizer, load_tokenizer
from services.controller.config import ControllerConfig
from services.controller.core import TrajectoryCore
from services.controller.policy import CheckpointPolicy, PolicyConfig
from tests.unit.model_fixtures import write_small_model
from workloads import load_workload
from workloads.episode import (
    MAX_CONTEXT_TOKENS,
    MAX_INVALID_IN_ROW,
    MAX_PROMPT_TOKENS,
    Episode,
    Execute,
    Generate,
    Limits,
    Observed,
    Response,
    Score,
    play,
    task_limits,
)

LIMITS = Limits(
    max_turns=10, max_invalid_in_row=MAX_INVALID_IN_ROW, max_prompt_tokens=MAX_PROMPT_TOKENS,
    max_context_tokens=MAX_CONTEXT_TOKENS, max_response_tokens=64, observation_chars=200,
    action_timeout_s=5.0, deadline_s=100.0,
)  # fmt: skip
PROMPT = [("system", "Fix the bug."), ("user", "The test fails.")]
RESPONSES = [
    "THOUGHT: look first.\n```bash\ncat calc.py\n```",
    "Answer: 3",  # not how a sandbox task ends: an invalid response, told so
    "```bash\nsed -i 's/-/+/' calc.py\n```",
    "```bash\nsubmit\n```",
]


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatFormat:
    tok: Tokenizer = load_tokenizer(write_small_model(tmp_path_factory.mktemp("m")))
    return ChatFormat(tok)


@dataclass
class Scripted:
    """An ``EpisodeIO`` that answers with fixed responses and command outputs."""

    chat: ChatFormat
    responses: list[str]
    commands: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)

    async def generate(self, step: Generate) -> Response:
        self.seeds.append(step.seed)
        text = self.responses[len(self.seeds) - 1]
        ids = [*self.chat.tokenizer.encode(text), self.chat.im_end]
        return Response(ids, [-0.5] * len(ids), [2] * len(ids), text)

    async def execute(self, step: Execute) -> Observed:
        self.commands.append(step.command)
        return Observed(f"out {len(self.commands)}\n", "", 0, env_s=0.1)

    async def score(self, step: Score) -> float:
        return 1.0 if step.reason == "answered" else 0.0


def episode(chat: ChatFormat, cls: type[Episode] = Episode, **extra: Any) -> Episode:
    """``extra``: more of ``cls``'s fields (Any: each value is typed as the field it names)."""
    return cls(
        trajectory_id="t-s0-a0", prompt_ids=chat.prompt(PROMPT), limits=LIMITS, sample_seed=5,
        has_sandbox=True, started_at=0.0, observation_ids=chat.observation, **extra,
    )  # fmt: skip


async def test_play_runs_the_agent_loop(chat: ChatFormat) -> None:
    ep = episode(chat)
    io = Scripted(chat, RESPONSES)
    finish = await play(ep, io, lambda: 1.0)
    assert (finish.reason, finish.reward) == ("answered", 1.0)
    assert io.commands == ["cat calc.py", "sed -i 's/-/+/' calc.py"]
    assert ep.turn == 4 and [a.command for a in ep.actions] == io.commands
    text = chat.tokenizer.decode(ep.response_ids)
    assert "exit_code: 0\nout 1" in text and "exit_code: 0\nout 2" in text
    assert "Invalid response: a final 'Answer:' does not end a sandbox task" in text
    # Model tokens carry mask 1 and their log-probabilities; observations mask 0.
    assert all((m == 1) == (lp == -0.5) for m, lp in zip(ep.loss_mask, ep.logprobs, strict=True))
    assert len(set(io.seeds)) == 4  # a seed per turn


async def test_the_controller_runs_the_same_episode(chat: ChatFormat) -> None:
    """The same responses through the controller's core: bit for bit the same context."""
    plain = episode(chat)
    await play(plain, Scripted(chat, RESPONSES), lambda: 1.0)
    policy = CheckpointPolicy(PolicyConfig(kind="never"))
    core = episode(chat, TrajectoryCore, policy=policy)
    assert isinstance(core, TrajectoryCore)
    io = Scripted(chat, RESPONSES)
    finish = await play(core, io, lambda: 1.0)
    assert finish.reward == 1.0
    assert core.context == plain.context and core.loss_mask == plain.loss_mask
    assert core.logprobs == plain.logprobs and core.weight_versions == plain.weight_versions
    assert [a.command for a in core.actions] == [a.command for a in plain.actions]
    assert core.recovery.entries == []  # no recovery happened; its log stays empty


async def test_unparseable_responses_end_the_episode_at_the_one_limit(chat: ChatFormat) -> None:
    ep = episode(chat)
    io = Scripted(chat, ["no block here"] * 10)
    finish = await play(ep, io, lambda: 1.0)
    assert finish.reason == "malformed" and finish.reward == 0.0
    assert ep.turn == MAX_INVALID_IN_ROW


def test_limits_are_declared_once() -> None:
    cfg = ControllerConfig()
    assert (cfg.max_invalid_in_row, cfg.max_prompt_tokens, cfg.max_context_tokens) == (
        MAX_INVALID_IN_ROW, MAX_PROMPT_TOKENS, MAX_CONTEXT_TOKENS,
    )  # fmt: skip
    task = load_workload("math").held_out(1)[0]
    limits = task_limits(task, max_response_tokens=16)
    assert limits.max_turns == task.limits.max_turns == 1
    assert limits.max_response_tokens == min(16, task.limits.max_response_tokens)
    assert limits.max_invalid_in_row == MAX_INVALID_IN_ROW
