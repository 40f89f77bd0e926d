"""Prompt lookup (``services.worker.engine.draft``): which tokens it proposes."""

from __future__ import annotations

import pytest

from services.worker.engine.draft import PromptLookup, share_rows


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


def test_a_guess_names_the_length_of_the_match_that_found_it() -> None:
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert PromptLookup().guess(tokens, 2) == ([4, 1], 3)  # (1, 2, 3) occurred before
    assert PromptLookup().guess([5, 9, 6, 9], 2) == ([6, 9], 1)  # only (9,) did
    assert PromptLookup().guess([1, 2, 3], 2) == ([], 0)
    assert PromptLookup().guess(tokens, 0) == ([], 0)


def test_draft_rows_are_shared_round_by_round_up_to_the_budget() -> None:
    assert share_rows([3, 0, 1, 2], 8) == [3, 0, 1, 2]  # every limit reached first
    assert share_rows([3, 0, 1, 2], 4) == [2, 0, 1, 1]  # round one: 3 rows; round two: 1
    assert share_rows([3, 3, 3], 2) == [1, 1, 0]  # a round cut short goes in order
    assert share_rows([3, 3, 3], 0) == [0, 0, 0]
    # A second share starts from the first's counts (the engine's confident guesses).
    assert share_rows([7, 0, 7], 4, [1, 1, 1]) == [3, 1, 3]
    assert share_rows([1, 0, 7], 4, [1, 1, 1]) == [1, 1, 5]


def test_a_sequence_is_trusted_once_most_of_its_drafts_were_kept() -> None:
    lookup = PromptLookup()
    assert not lookup.trusted
    lookup.fed, lookup.kept = 3, 3  # too few to tell
    assert not lookup.trusted
    lookup.fed, lookup.kept = 5, 4
    assert lookup.trusted
    lookup.fed, lookup.kept = 10, 7
    assert not lookup.trusted
