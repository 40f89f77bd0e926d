"""``belayer run``'s held-out evaluation: every held-out task once, greedy (temperature 0), on
the node's current weights — through the router like any rollout, in a real sandbox for SWE
tasks — scored by the task's own reward function (``workloads.score``). The episodes are not
published to ``TRAJECTORIES``, so the trainer never trains on them.

Each episode is the controller's own (``workloads.episode``: the same prompt and observation
texts, the same limits, the same invalid-response rule), played at temperature 0 through the
router and a fresh sandbox; only checkpoints and recovery are left out (an infrastructure
failure fails the episode, which is then run once more)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from common.errors import BelayerError, InvalidRequest
from model.chat import ChatFormat
from schemas.serving import GenerateRequest, SamplingParams
from services.environment.client import EnvClient
from services.router.client import generate
from workloads import ResponseText, SandboxHandle, Task, Workload, exact_match
from workloads.episode import (
    Episode,
    Execute,
    Generate,
    Observed,
    Response,
    Score,
    play,
    task_limits,
)
from workloads.runner import open_sandbox, run_action

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


@dataclass
class _BusIO:
    """The episode's world over the bus: the router (greedy), the task's sandbox, its reward."""

    nc: Any
    env: EnvClient | None
    workload: Workload
    task: Task
    sandbox_id: str = ""
    versions: set[int] = field(default_factory=set)
    exact: bool | None = None
    episode: Episode | None = None
    """The episode played (its generated token ids go to a reward service)."""

    async def generate(self, step: Generate) -> Response:
        req = GenerateRequest(
            request_id=step.request_id,
            prompt_token_ids=step.prompt_ids,
            sampling=SamplingParams(temperature=0.0, max_tokens=step.max_tokens),
            stream=False,
        )
        result = await generate(self.nc, req, timeout=120.0)
        versions = result.token_weight_versions or [result.weight_version] * len(result.token_ids)
        self.versions |= set(versions)
        return Response(list(result.token_ids), list(result.logprobs), list(versions), result.text)

    async def execute(self, step: Execute) -> Observed:
        assert self.env is not None
        r = await run_action(self.env, self.task, self.sandbox_id, step.command)
        return Observed(
            r.stdout, r.stderr, r.exit_code, timed_out=r.timed_out, truncated=r.truncated
        )

    async def score(self, step: Score) -> float:
        ep = self.episode
        ids = (
            tuple(t for t, m in zip(ep.response_ids, ep.loss_mask, strict=True) if m) if ep else ()
        )
        if self.task.sandbox is None:
            self.exact = exact_match(self.task, step.text)
            text = ResponseText(step.text, token_ids=ids)
            return float(await self.workload.reward(self.task, text))
        assert self.env is not None
        handle = SandboxHandle(
            ops=self.env, sandbox_id=self.sandbox_id, response=step.text, token_ids=ids
        )
        return float(await self.workload.reward(self.task, handle))


async def _episode(
    nc: Any,
    env: EnvClient | None,
    workload: Workload,
    task: Task,
    chat: ChatFormat,
    *,
    request_prefix: str,
) -> tuple[float, bool | None, int, set[int]]:
    """One held-out episode: the controller's episode (``workloads.episode``), greedy, played
    through the router and a fresh sandbox, published nowhere."""
    episode = Episode(
        trajectory_id=request_prefix,
        prompt_ids=chat.prompt((m.role, m.content) for m in task.prompt),
        limits=task_limits(task, vocab_size=chat.tokenizer.vocab_size),
        sample_seed=0,
        has_sandbox=task.sandbox is not None,
        started_at=time.monotonic(),
        observation_ids=chat.observation,
    )
    io = _BusIO(nc, env if task.sandbox is not None else None, workload, task, episode=episode)
    if task.sandbox is not None:
        if env is None:
            raise InvalidRequest("a sandbox task needs the environment service", task_id=task.id)
        io.sandbox_id = await open_sandbox(env, task)
    try:
        finish = await play(episode, io, time.monotonic)
    finally:
        if io.sandbox_id and env is not None:
            await env.destroy(io.sandbox_id)
    return finish.reward, io.exact, episode.turn, io.versions
