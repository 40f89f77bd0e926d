"""``belayer run``'s held-out evaluation: every held-out task once, greedy (temperature 0), on
the node's current weights — through the router like any rollout, in a real sandbox for SWE
tasks — scored by the task's own reward function (``workloads.score``). The episodes are not
published to ``TRAJECTORIES``, so the trainer never trains on them.

The agent loop is the controller's convention (``workloads.actions``, ``model.chat``): the
prompt turns and the generation header, one response per turn, its action run in the
sandbox, the observation as the next user turn; three unparseable responses in a row, the
turn limit or the context limit end the episode, and it is scored as it stands."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from common.errors import BelayerError
from model.chat import ChatFormat
from schemas.serving import GenerateRequest, SamplingParams
from services.environment.client import EnvClient
from services.router.client import generate
from workloads import (
    AnswerAction,
    BashAction,
    SandboxHandle,
    SubmitAction,
    Task,
    Workload,
    exact_match,
    invalid_action_observation,
    parse_action,
    score,
)
from workloads.runner import open_sandbox, run_action

MAX_INVALID_IN_ROW = 3
"""As the controller: this many unparseable responses in a row end an episode."""
MAX_CONTEXT = 2048
"""Prompt + response tokens (the tiny model's context)."""
MAX_PROMPT = 1536
"""Longest prompt the router takes."""
CONCURRENCY = 8
"""Episodes at once."""


@dataclass
class EvalResult:
    """The held-out greedy evaluation after one step."""

    rewards: dict[str, float] = field(default_factory=dict)
    """Task id → reward."""
    exact: dict[str, bool] = field(default_factory=dict)
    """Task id → exact match of the final answer (answer tasks only)."""
    turns: dict[str, int] = field(default_factory=dict)
    """Task id → model turns."""
    versions: set[int] = field(default_factory=set)
    """Weight versions the responses came from."""
    errors: list[str] = field(default_factory=list)
    """Episodes that failed twice on infrastructure (scored 0), with the error."""
    seconds: float = 0.0

    @property
    def mean(self) -> float:
        return sum(self.rewards.values()) / len(self.rewards) if self.rewards else 0.0

    @property
    def exact_mean(self) -> float | None:
        """Exact-match accuracy over the answer tasks (``None`` when there were none)."""
        return sum(self.exact.values()) / len(self.exact) if self.exact else None


async def evaluate(
    nc: Any,
    workload: Workload,
    tasks: list[Task],
    chat: ChatFormat,
    *,
    tag: str,
    on_done: Any = None,
) -> EvalResult:
    """Run every task of ``tasks`` once, greedily; ``tag`` names the requests (unique per
    evaluation); ``on_done()`` after each episode."""
    t0 = time.monotonic()
    out = EvalResult()
    env = EnvClient(nc) if any(t.sandbox is not None for t in tasks) else None
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, task: Task) -> None:
        async with limit:
            for attempt in range(2):  # an infrastructure failure: the episode once more
                try:
                    reward, exact, turns, versions = await _episode(
                        nc, env, workload, task, chat, request_prefix=f"{tag}-{i}-a{attempt}"
                    )
                    break
                except BelayerError as exc:
                    if attempt == 1:
                        out.errors.append(f"{task.id}: {exc.code}: {exc}")
                        reward, exact, turns, versions = 0.0, None, 0, set()
        out.rewards[task.id] = reward
        if exact is not None:
            out.exact[task.id] = exact
        out.turns[task.id] = turns
        out.versions |= versions
        if on_done is not None:
            on_done()

    await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    out.seconds = time.monotonic() - t0
    return out


async def _episode(
    nc: Any,
    env: EnvClient | None,
    workload: Workload,
    task: Task,
    chat: ChatFormat,
    *,
    request_prefix: str,
) -> tuple[float, bool | None, int, set[int]]:
    context = chat.prompt((m.role, m.content) for m in task.prompt)
    sid = await open_sandbox(env, task) if task.sandbox is not None and env else ""
    turns = invalid = 0
    text = ""
    versions: set[int] = set()
    try:
        while turns < task.limits.max_turns:
            room = MAX_CONTEXT - len(context)
            if len(context) > MAX_PROMPT or room < 1:
                break
            turns += 1
            req = GenerateRequest(
                request_id=f"{request_prefix}-g{turns}",
                prompt_token_ids=context,
                sampling=SamplingParams(
                    temperature=0.0, max_tokens=min(task.limits.max_response_tokens, room)
                ),
                stream=False,
            )
            result = await generate(nc, req, timeout=120.0)
            versions |= set(result.token_weight_versions or [result.weight_version])
            text = result.text
            action = parse_action(text)
            if task.sandbox is None or env is None:  # single-turn: the answer is final
                exact = exact_match(task, text)
                if isinstance(action, AnswerAction):
                    return float(await workload.reward(task, text)), exact, turns, versions
                return 0.0, exact, turns, versions
            context = context + list(result.token_ids)
            if isinstance(action, SubmitAction):
                break
            if isinstance(action, BashAction):
                invalid = 0
                step = await run_action(env, task, sid, action.command)
                observation = step.observation
            else:
                invalid += 1
                if invalid >= MAX_INVALID_IN_ROW:
                    break
                reason = getattr(action, "reason", "a final 'Answer:' does not end a sandbox task")
                observation = invalid_action_observation(reason)
            context = context + chat.observation(result.token_ids, observation)
        if task.sandbox is None or env is None:
            scored = await score(task, text)
            return float(scored.reward), scored.exact, turns, versions
        handle = SandboxHandle(ops=env, sandbox_id=sid)
        return float(await workload.reward(task, handle)), None, turns, versions
    finally:
        if sid and env is not None:
            await env.destroy(sid)
