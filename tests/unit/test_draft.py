"""Prompt lookup (``services.worker.engine.draft``): which tokens it proposes."""

from __future__ import annotations

import pytest

from services.worker.engine.draft import PromptLookup


def test_the_longest_suffix_ngram_proposes_what_followed_it() -> None:
    # Suffix (1, 2, 3) occurred at 0..2, followed by 9, 9; the 1-gram (3,) also occurred
    # later (followed by 7) but the longer match wins.
    tokens = [1, 2, 3, 9, 9, 4, 3, 7, 5, 1, 2, 3]
    assert PromptLookup().propose(tokens, 2) == [9, 9]


def test_the_newest_occurrence_with_k_tokens_after_it_wins() -> None:
    tokens = [5, 6, 1, 5, 6, 2, 8, 5, 6]
    lookup = PromptLookup()
    assert lookup.propose(tokens, 2) == [2, 8]  # the newest earlier (5, 6)
    assert PromptLookup().propose(tokens, 5) == [1, 5, 6, 2, 8]  # only the oldest has 5 after it


def test_a_run_of_one_token_proposes_k_more() -> None:
    assert PromptLookup().propose([4] + [7] * 10, 5) == [7] * 5


def test_nothing_to_propose() -> None:
    lookup = PromptLookup()
    assert lookup.propose([1, 2, 3, 4], 3) == []  # no suffix n-gram occurred before
    assert lookup.propose([1, 2, 3, 4], 0) == []
    assert PromptLookup().propose([1], 3) == []


def test_the_index_grows_with_the_sequence() -> None:
    tokens = [1, 2, 3, 4]
    lookup = PromptLookup()
    assert lookup.propose(tokens, 2) == []
    tokens += [1, 2]
    assert lookup.propose(tokens, 2) == [3, 4]
    tokens += [3, 8]
    assert lookup.propose(tokens, 3) == []  # (3, 8), (8,) never occurred before
    tokens += [1]
    assert lookup.propose(tokens, 1) == [2]  # (8, 1) no; (1,): the newest is at 4 → 2
    with pytest.raises(ValueError, match="only grow"):
        lookup.propose([1, 2], 1)
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookup(0)
