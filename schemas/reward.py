"""The reward service protocol (``belayer.reward.<name>``, request/reply, MessagePack): the
controller asks a service — written in any language, docs/protocol.md "Reward services" — to
score one finished trajectory."""

from __future__ import annotations

from typing import Annotated

import msgspec

from schemas.base import Id, IdOrEmpty, Message


class ChatTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of the task's prompt."""

    role: str
    content: str


class RewardRequest(Message, tag="RewardRequest.v1"):
    """Controller → reward service: one trajectory to score."""

    trajectory_id: IdOrEmpty
    """The trajectory (``<rollout>-s<slot>-a<attempt>``): the same id is asked again after a
    retry, so a service may cache by it (empty: not a rollout's, e.g. a held-out evaluation)."""
    workload: str
    task_id: Id
    prompt: list[ChatTurn]
    """The task's chat, as the model saw it."""
    response: str
    """The model's final response text (special tokens dropped)."""
    answer: str = ""
    """The task's reference answer (empty: none)."""
    metadata: dict[str, str] = {}
    """The task's columns (generator, source row, …)."""
    response_token_ids: list[int] = []
    """The token ids the model generated in this trajectory, every turn (tool observations
    left out): for a one-turn answer task, the tokens of ``response`` (ending in the
    end-of-turn token when the model stopped there). Empty: not known to the sender."""
    sandbox_id: IdOrEmpty = ""
    """The sandbox the agent finished in (sandbox tasks; still running while the service
    scores); empty for an answer task."""


class RewardReply(Message, tag="RewardReply.v1"):
    """Reward service → controller."""

    score: Annotated[float, msgspec.Meta(ge=-1e6, le=1e6)] | None
    """The reward; ``None``: not applicable to this trajectory (combined as TRL combines
    ``None``)."""
    metrics: dict[str, float] = {}
    """Anything else worth logging (not used by training)."""
