"""Prompt lookup: the longest match wins, then its latest occurrence; the index equals a scan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.spec import NgramIndex, NgramProposer


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


def test_the_tokens_after_the_match_are_proposed():
    assert NgramIndex(2, 3).propose([1, 2, 3, 4, 5, 9, 2, 3], k=3) == [4, 5, 9]


def test_the_longest_match_wins_over_a_later_shorter_one():
    # [7, 2, 3] occurs once, early; [2, 3] alone occurs later, followed by 8.
    tokens = [7, 2, 3, 4, 4, 2, 3, 8, 8, 7, 2, 3]
    assert NgramIndex(1, 3).propose(tokens, k=2) == [4, 4]
    assert NgramIndex(1, 2).propose(tokens, k=2) == [8, 8]


def test_the_latest_occurrence_wins():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert NgramIndex(2, 2).propose(tokens, k=1) == [2]


def test_k_caps_the_proposal_and_zero_proposes_nothing():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramIndex(2, 2).propose(tokens, k=2) == [3, 4]
    assert NgramIndex(2, 2).propose(tokens, k=0) == []


def test_a_match_running_into_the_end_repeats_itself():
    # [1, 2] last occurred at 2; after it come 1, 2, and the proposal continues the period.
    assert NgramIndex(2, 2).propose([1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]


def test_no_match_and_too_short_sequences_propose_nothing():
    assert NgramIndex(2, 3).propose([1, 2, 3, 4, 5], k=3) == []
    assert NgramIndex(1, 1).propose([7], k=3) == []  # nothing before the last token
    assert NgramIndex(3, 3).propose([1, 1, 1], k=2) == []  # a 3-gram needs a 4th token to recur
    assert NgramIndex(2, 2).propose([], k=2) == []


def test_the_index_follows_a_growing_sequence():
    index = NgramIndex(2, 2)
    tokens = [1, 2, 3]
    assert index.propose(tokens, k=1) == []
    tokens += [1, 2]
    assert index.propose(tokens, k=1) == [3]
    tokens += [4, 1, 2]
    assert index.propose(tokens, k=2) == [4, 1]


def test_an_index_given_a_different_shorter_list_starts_over():
    index = NgramIndex(1, 1)
    assert index.propose([1, 2, 1], k=1) == [2]
    assert index.propose([3, 3], k=1) == [3]


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(0, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, 3)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=60),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(0, 6),
    cut=st.integers(0, 60),
)
def test_the_incremental_index_proposes_what_a_full_scan_finds(tokens, bounds, k, cut):
    """Proposing at an earlier length first (the index then catches up) changes nothing."""
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    index = NgramIndex(min_n, max_n)
    index.propose(tokens[: min(cut, len(tokens))], k=1)
    assert index.propose(tokens, k) == naive_proposal(tokens, min_n, max_n, k)


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=40), k=st.integers(1, 4))
def test_proposing_after_every_token_matches_the_scan_at_every_length(tokens, k):
    index = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        assert index.propose(tokens[:end], k) == naive_proposal(tokens[:end], 1, 3, k)


def test_the_proposer_batches_sequences_with_their_own_k_and_forgets_finished_ones():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=2)
    sequences = {"a": [1, 2, 3, 1, 2], "b": [4, 5, 4], "c": [6, 7, 8]}
    out = proposer.propose(list(sequences), list(sequences.values()), [2, 3, 2])
    assert out == [[3, 1], [5, 4, 5], []]
    assert proposer.propose(["a", "b"], [sequences["a"], sequences["b"]], [0, 1]) == [[], [5]]
    proposer.release("a")
    proposer.release("a")
    assert proposer.num_indexed_sequences == 2
    with pytest.raises(ValueError, match="draft lengths"):
        proposer.propose(["a"], [[1]], [1, 2])
