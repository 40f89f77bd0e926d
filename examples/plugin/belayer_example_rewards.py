"""Example reward functions, shaped like TRL's: ``fn(prompts, completions, **columns) ->
list[float | None]``. Belayer calls them with lists of one (one trajectory at a time), in
TRL's conversational format, with the task's columns (``task_id``, ``answer`` and its
``metadata`` keys) as keyword arguments::

    PYTHONPATH=examples/plugin belayer up --workload-plugin belayer_example_tasks:make \\
        --reward-function belayer_example_rewards:exact --reward-function belayer_example_rewards:brevity
    PYTHONPATH=examples/plugin belayer rollout belayer_example_tasks:make \\
        --reward belayer_example_rewards:exact --reward belayer_example_rewards:brevity \\
        --reward-weights 1 --reward-weights 0.1
"""

from __future__ import annotations

from typing import Any


def _text(completion: list[dict[str, str]]) -> str:
    return completion[-1]["content"]


def exact(
    prompts: list[Any], completions: list[Any], answer: list[str], **_: Any
) -> list[float | None]:
    """1.0 when the last ``Answer:`` line is the reference answer, else 0.0."""
    out: list[float | None] = []
    for completion, ref in zip(completions, answer, strict=True):
        lines = [ln for ln in _text(completion).splitlines() if ln.startswith("Answer:")]
        out.append(1.0 if lines and lines[-1].removeprefix("Answer:").strip() == ref else 0.0)
    return out


def brevity(prompts: list[Any], completions: list[Any], **_: Any) -> list[float | None]:
    """Shorter is better: 1 - characters / 100, at least 0."""
    return [max(0.0, 1.0 - len(_text(c)) / 100) for c in completions]


def vowels_only(
    prompts: list[Any], completions: list[Any], word: list[str], **_: Any
) -> list[float | None]:
    """Applies only to words that start with a vowel (None otherwise: not applicable)."""
    return [1.0 if w[0] in "aeiou" else None for w in word]


def broken(prompts: list[Any], completions: list[Any], **_: Any) -> list[float | None]:
    """Always raises: what a bug in a reward function does to a rollout (one typed record per
    trajectory, ``reward_error``; the rollout and the training step go on)."""
    raise ValueError("this reward function is broken on purpose")
