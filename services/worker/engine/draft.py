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


TRUSTED_RATE = 0.8
"""Fraction of a sequence's draft tokens kept from which :attr:`PromptLookup.trusted` holds."""
TRUSTED_AFTER = 4
"""Draft tokens a sequence is fed before :attr:`PromptLookup.trusted` can hold."""


class PromptLookup:
    """An index of every n-gram (1 to ``max_ngram`` tokens) of one sequence, by end position."""

    def __init__(self, max_ngram: int = PROMPT_LOOKUP_MAX) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self._ends: dict[tuple[int, ...], list[int]] = {}
        """n-gram → the positions just past each of its occurrences, ascending."""
        self._indexed = 0
        self.fed = 0
        """Draft tokens fed from this sequence's guesses so far (the engine records them)."""
        self.kept = 0
        """Of those, the tokens kept."""

    @property
    def trusted(self) -> bool:
        """Whether this sequence's drafts have been kept at least ``TRUSTED_RATE`` of the time
        (over ``TRUSTED_AFTER`` or more): its full-length matches then get more draft rows."""
        return self.fed >= TRUSTED_AFTER and self.kept >= TRUSTED_RATE * self.fed

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
        return self.guess(tokens, k)[0]

    def guess(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """:meth:`propose`'s tokens and the length of the suffix n-gram they were found by
        (0 with none): a guess from a ``max_ngram``-token match is kept far more often than
        one from a shorter match (the engine gives it more draft rows)."""
        if k < 1:
            return [], 0
        self._update(tokens)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            ends = self._ends.get(tuple(tokens[length - n :]))
            if ends is None or len(ends) < 2:
                continue  # only the suffix itself
            # Newest first, the suffix itself (ending at ``length``) excluded.
            for end in reversed(ends[:-1]):
                if length - end >= k:
                    return tokens[end : end + k], n
            return tokens[ends[0] : ends[0] + k], n  # the oldest has the most after it
        return [], 0


def share_rows(limits: list[int], budget: int, counts: list[int] | None = None) -> list[int]:
    """Draft rows per sequence: one more for every sequence below its limit, in order, round
    after round, until ``budget`` more rows are handed out or every limit is reached; from
    ``counts`` (default none yet)."""
    counts = [0] * len(limits) if counts is None else list(counts)
    left = budget
    while left > 0:
        open_ = [i for i, (c, n) in enumerate(zip(counts, limits, strict=True)) if c < n]
        if not open_:
            break
        for i in open_[:left]:
            counts[i] += 1
        left -= min(left, len(open_))
    return counts
