"""A trajectory whose last response filled the model's context ends with an observation past
it (the controller appends it before it sees the context is full): the trainer drops what
follows the last model token — never trained, and causally irrelevant to what precedes it —
and refuses a sample still longer than the model (instead of crashing on it in every restart)."""

from __future__ import annotations

import pytest

from services.trainer.core import Sample, validate_sample, without_trailing_context


def sample(mask: tuple[int, ...], prompt: int = 3) -> Sample:
    n = len(mask)
    return Sample(
        trajectory_id="t", group_id="g", sample_index=0, prompt_ids=tuple(range(prompt)),
        response_ids=tuple(range(100, 100 + n)), loss_mask=mask,
        rollout_logprobs=tuple(-0.5 if m else 0.0 for m in mask),
        weight_versions=tuple(1 if m else -1 for m in mask), reward=1.0,
    )  # fmt: skip


def test_tokens_after_the_last_model_token_are_dropped() -> None:
    s = without_trailing_context(sample((1, 1, 0, 0, 1, 0, 0, 0)))
    assert s.loss_mask == (1, 1, 0, 0, 1)
    assert s.response_ids == (100, 101, 102, 103, 104)
    assert s.rollout_logprobs == (-0.5, -0.5, 0.0, 0.0, -0.5)
    assert s.weight_versions == (1, 1, -1, -1, 1)
    assert s.model_tokens == 3


def test_a_sample_ending_on_a_model_token_is_unchanged() -> None:
    s = sample((0, 1, 1))
    assert without_trailing_context(s) is s


def test_a_sample_longer_than_the_model_is_refused() -> None:
    s = without_trailing_context(sample((1,) * 6 + (0,) * 4, prompt=10))
    validate_sample(s, max_len=16)  # 10 + 6 after the trailing observation went
    with pytest.raises(ValueError, match="longer than the model's 15"):
        validate_sample(s, max_len=15)
