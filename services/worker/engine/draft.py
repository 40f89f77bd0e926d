"""Draft tokens for speculative decoding by prompt lookup (n-gram matching), as in vLLM's
``ngram`` speculator and Hugging Face's ``prompt_lookup_num_tokens``.

A sequence's next tokens are guessed from its own text: the longest suffix n-gram
(``max_ngram`` down to 1 tokens) that occurred earlier in the sequence (prompt and generated
tokens alike) proposes the tokens that followed that earlier occurrence — the most recent
occurrence that has ``k`` tokens after it, else the one with the most. Agent transcripts repeat
themselves (a command names a file the observation printed, a test's output echoes the code),
so the guesses are often right; a wrong guess costs a row of the step, never a token (the
engine verifies every draft: :mod:`services.worker.engine.llm_engine`).

Pure and incremental: :class:`PromptLookup` indexes each new token once (``max_ngram`` dict
entries per token), so proposing is O(1) in the sequence's length.
"""

from __future__ import annotations

PROMPT_LOOKUP_MAX = 3
"""Longest suffix n-gram looked up (vLLM's ``prompt_lookup_max``)."""


class PromptLookup:
    """An index of every n-gram (1 to ``max_ngram`` tokens) of one sequence, by end position."""

    def __init__(self, max_ngram: int = PROMPT_LOOKUP_MAX) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self._ends: dict[tuple[int, ...], list[int]] = {}
        """n-gram → the positions just past each of its occurrences, ascending."""
        self._indexed = 0

    def _update(self, tokens: list[int]) -> None:
        if len(tokens) < self._indexed:
            raise ValueError("a sequence's tokens only grow; build a new index for another")
        for end in range(self._indexed + 1, len(tokens) + 1):
            for n in range(1, min(self.max_ngram, end) + 1):
                self._ends.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self._indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``tokens`` (the same growing list on every
        call); empty when no suffix n-gram occurred before."""
        if k < 1:
            return []
        self._update(tokens)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            ends = self._ends.get(tuple(tokens[length - n :]))
            if ends is None or len(ends) < 2:
                continue  # only the suffix itself
            # Newest first, the suffix itself (ending at ``length``) excluded.
            for end in reversed(ends[:-1]):
                if length - end >= k:
                    return tokens[end : end + k]
            return tokens[ends[0] : ends[0] + k]  # the oldest has the most after it
        return []
