"""Asking a reward service on the bus (``belayer.reward.<name>``, ``RewardRequest`` →
``RewardReply``) for one trajectory's score, with a deadline per try and bounded retries.
Every way of not getting a score is ``RewardFailed`` — the trajectory's reward failed, it is
recorded and counted, and never read as 0 (docs/workloads.md, "Reward services")."""

from __future__ import annotations

import asyncio
from typing import Any

from common import subjects
from common.bus import request
from common.errors import BelayerError, BusUnavailable, RewardFailed, Timeout
from schemas.reward import ChatTurn, RewardReply, RewardRequest
from workloads.base import Outcome, SandboxHandle, Task

RETRY_DELAY_S = 0.25
"""First wait before another try (doubling)."""


def reward_request(task: Task, outcome: Outcome) -> RewardRequest:
    """What a reward service is asked about ``outcome`` of ``task``: the response text, the
    token ids and the trajectory id a ``ResponseText`` carries (a plain ``str``: the text
    only), or a ``SandboxHandle``'s sandbox, response and token ids."""
    if isinstance(outcome, SandboxHandle):
        text, sandbox_id = outcome.response, outcome.sandbox_id
        token_ids, trajectory_id = outcome.token_ids, outcome.trajectory_id
    else:
        text, sandbox_id = str(outcome), ""
        token_ids = getattr(outcome, "token_ids", ())
        trajectory_id = getattr(outcome, "trajectory_id", "")
    return RewardRequest(
        trajectory_id=trajectory_id, workload=task.workload, task_id=task.id,
        prompt=[ChatTurn(role=m.role, content=m.content) for m in task.prompt],
        response=text, answer=task.reference_answer, metadata=dict(task.metadata),
        response_token_ids=list(token_ids), sandbox_id=sandbox_id,
    )  # fmt: skip


async def ask_reward_service(
    nc: Any, name: str, task: Task, outcome: Outcome, *, timeout_s: float, attempts: int
) -> float | None:
    """The score ``name`` gives ``outcome`` of ``task`` (``None``: not applicable).
    No responders and no answer in ``timeout_s`` are tried again, ``attempts`` times in all;
    an error the service answers is not (it would answer it again)."""
    req = reward_request(task, outcome)
    delay, last = RETRY_DELAY_S, ""
    for attempt in range(1, attempts + 1):
        try:
            reply: RewardReply = await request(
                nc, subjects.reward(name), req, RewardReply, timeout=timeout_s
            )
            return reply.score
        except (BusUnavailable, Timeout) as exc:
            last = f"{exc.code}: {exc}"
        except BelayerError as exc:
            raise RewardFailed(
                "the reward service answered an error", service=name, error=f"{exc.code}: {exc}"
            ) from None
        if attempt < attempts:
            await asyncio.sleep(delay)
            delay *= 2
    raise RewardFailed(
        "the reward service did not answer (unavailable or past its deadline)",
        service=name,
        attempts=attempts,
        timeout_s=timeout_s,
        last=last,
    )
