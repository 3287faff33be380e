"""Prompt lookup: the longest match wins, then its latest occurrence; the vectorised lookup
proposes what a plain scan of every n-gram finds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.spec import NgramProposer
from pagedkv.engine.spec.ngram import TokenArray, propose_from


def naive_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The module's rule, by scanning the whole sequence: for n from max_n down to min_n, the
    latest earlier start of the last n tokens; then k tokens of the sequence extended by the
    proposal itself."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        starts = [s for s in range(length - n) if tokens[s : s + n] == suffix]
        if starts:
            extended = list(tokens)
            for i in range(k):
                extended.append(extended[starts[-1] + n + i])
            return extended[length:]
    return []


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return propose_from(np.asarray(tokens, dtype=np.int32), min_n, max_n, k)


def test_the_tokens_after_the_match_are_proposed():
    assert lookup([1, 2, 3, 4, 5, 9, 2, 3], 2, 3, k=3) == [4, 5, 9]


def test_the_longest_match_wins_over_a_later_shorter_one():
    # [7, 2, 3] occurs once, early; [2, 3] alone occurs later, followed by 8.
    tokens = [7, 2, 3, 4, 4, 2, 3, 8, 8, 7, 2, 3]
    assert lookup(tokens, 1, 3, k=2) == [4, 4]
    assert lookup(tokens, 1, 2, k=2) == [8, 8]


def test_the_latest_occurrence_wins():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert lookup(tokens, 2, 2, k=1) == [2]


def test_k_caps_the_proposal_and_zero_proposes_nothing():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert lookup(tokens, 2, 2, k=2) == [3, 4]
    assert lookup(tokens, 2, 2, k=0) == []


def test_a_match_running_into_the_end_repeats_itself():
    # [1, 2] last occurred at 2; after it come 1, 2, and the proposal continues the period.
    assert lookup([1, 2, 1, 2], 2, 2, k=5) == [1, 2, 1, 2, 1]


def test_no_match_and_too_short_sequences_propose_nothing():
    assert lookup([1, 2, 3, 4, 5], 2, 3, k=3) == []
    assert lookup([7], 1, 1, k=3) == []  # nothing before the last token
    assert lookup([1, 1, 1], 3, 3, k=2) == []  # a 3-gram needs a 4th token to recur
    assert lookup([], 2, 2, k=2) == []


def test_the_token_array_follows_a_growing_list_and_restarts_on_another():
    array, tokens = TokenArray(), [1, 2, 3]
    assert array.sync(tokens).tolist() == [1, 2, 3]
    tokens += list(range(100))  # past the first capacity
    assert array.sync(tokens).tolist() == tokens
    assert array.sync([7, 8]).tolist() == [7, 8]
    assert array.sync([]).tolist() == []


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(4, 3)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=60),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(0, 6),
    cut=st.integers(0, 60),
)
def test_the_lookup_proposes_what_a_full_scan_finds(tokens, bounds, k, cut):
    """Through the proposer, having proposed at an earlier length first (its array then
    catches up with the list)."""
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    proposer = NgramProposer(min_n, max_n)
    proposer.propose(["s"], [tokens[: min(cut, len(tokens))]], [1])
    assert proposer.propose(["s"], [tokens], [k]) == [naive_proposal(tokens, min_n, max_n, k)]


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=40), k=st.integers(1, 4))
def test_proposing_after_every_token_matches_the_scan_at_every_length(tokens, k):
    proposer, grown = NgramProposer(1, 3), []
    for token in tokens:
        grown.append(token)  # the same list, growing in place as a sequence's does
        assert proposer.propose([0], [grown], [k]) == [naive_proposal(grown, 1, 3, k)]


def test_the_proposer_batches_sequences_with_their_own_k_and_forgets_finished_ones():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=2)
    sequences = {"a": [1, 2, 3, 1, 2], "b": [4, 5, 4], "c": [6, 7, 8]}
    out = proposer.propose(list(sequences), list(sequences.values()), [2, 3, 2])
    assert out == [[3, 1], [5, 4, 5], []]
    assert proposer.propose(["a", "b"], [sequences["a"], sequences["b"]], [0, 1]) == [[], [5]]
    proposer.release("a")
    proposer.release("a")
    assert proposer.num_tracked_sequences == 2
    with pytest.raises(ValueError, match="draft lengths"):
        proposer.propose(["a"], [[1]], [1, 2])
