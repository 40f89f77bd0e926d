"""What one request may ask of an engine, and how much work an engine takes at once.

The router refuses requests beyond these limits, and every rollout worker refuses them too (a
submit that reached the worker without passing the router). Declared once, here; the router's
and the worker's configs both nest it, and the supervisor forwards the router's to every
worker and shadow of the node, so the two sides can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import ResourceLimit


@dataclass(frozen=True)
class ServingLimits:
    """Request and queue limits shared by the router and the rollout workers."""

    max_prompt_tokens: int = 1536
    """Longer prompts are refused with ``resource_limit``."""
    max_new_tokens: int = 4096
    """Upper bound on ``sampling.max_tokens`` (and on the tokens a resumed request already
    holds)."""
    max_queued: int = 64
    """Requests an engine holds beyond its running batch (``max_num_seqs``); a worker refuses
    more with the retryable ``engine_unavailable``, and the router keeps them itself until an
    engine has room."""
    max_prompt_bytes: int = 65_536
    """Longer prompt texts (UTF-8 bytes) are refused with ``resource_limit`` before they are
    tokenized (tokenizing costs time: a 2 MiB prompt took over a second)."""

    def __post_init__(self) -> None:
        if (
            min(self.max_prompt_tokens, self.max_new_tokens, self.max_prompt_bytes) < 1
            or self.max_queued < 0
        ):
            raise ValueError(
                "limits must be positive (max_queued may be 0): "
                f"{self.max_prompt_tokens}, {self.max_new_tokens}, {self.max_queued}"
            )


def check_request(
    limits: ServingLimits,
    *,
    prompt_tokens: int,
    max_tokens: int,
    held_tokens: int = 0,
    prompt_field: str = "$.prompt",
    tokens_field: str = "$.sampling.max_tokens",
) -> None:
    """Refuse (``ResourceLimit`` naming the field) a request whose prompt is longer than
    ``max_prompt_tokens`` or that may generate more than ``max_new_tokens`` — counting the
    ``held_tokens`` a resumed request already generated apart from ``max_tokens`` still to
    come, each bounded on its own (a resume asks for at least one more token)."""
    if prompt_tokens > limits.max_prompt_tokens:
        raise ResourceLimit(
            "prompt too long",
            field=prompt_field,
            tokens=prompt_tokens,
            limit=limits.max_prompt_tokens,
        )
    if max_tokens > limits.max_new_tokens or held_tokens > limits.max_new_tokens:
        raise ResourceLimit(
            "max_tokens too large",
            field=tokens_field,
            tokens=max(max_tokens, held_tokens),
            limit=limits.max_new_tokens,
        )
