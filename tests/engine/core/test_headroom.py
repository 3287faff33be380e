"""Decode headroom arithmetic: the blocks a set of growing sequences will still take.

``peak_new_blocks`` is checked by hand on small cases and, with Hypothesis, against a plain
step-by-step replay of the same sequences (each appends one token per step after its delay,
and gives back its blocks once it has appended its last one).
"""

from hypothesis import given
from hypothesis import strategies as st

from pagedkv.engine.core.headroom import Growth, peak_new_blocks
from pagedkv.memory import blocks_for


def test_one_sequence_needs_the_blocks_of_its_remaining_tokens():
    # 5 tokens in 4-token blocks (2 blocks), 6 more: 11 tokens = 3 blocks, so 1 new block.
    assert peak_new_blocks([Growth(slots=5, remaining=6)], block_size=4) == 1
    assert Growth(slots=5, remaining=6).new_blocks(3, 4) == 0  # 8 tokens: still 2 blocks
    assert Growth(slots=5, remaining=6).new_blocks(4, 4) == 1


def test_a_short_request_gives_its_blocks_back_before_a_long_one_grows():
    short = Growth(slots=4, remaining=1, held=3)  # 5 tokens at step 1 (+1 block), then done
    long = Growth(slots=1, remaining=12)  # 1 -> 13 tokens: 1 -> 4 blocks over 12 steps
    # Summing final growths would ask for 1 + 3 blocks; the short one is gone after step 1, its
    # grown block and its 3 held ones back, before the long one needs its new blocks.
    assert peak_new_blocks([short, long], block_size=4) == 1
    # Had it held nothing of its own (shared blocks), only its grown block would come back.
    assert peak_new_blocks([Growth(slots=4, remaining=1), long], block_size=4) == 3


def test_a_request_that_forks_grows_once_per_sample_and_copies_its_shared_last_block():
    forking = Growth(slots=6, remaining=4, copies=3, copy_on_write=2)
    # 6 -> 10 tokens is 2 -> 3 blocks for each of 3 samples, plus 2 copy-on-write copies.
    assert forking.new_blocks(4, 4) == 3 * 1 + 2
    assert peak_new_blocks([forking], block_size=4) == 5


def test_a_delayed_prompt_grows_later_and_finishes_later():
    delayed = Growth(slots=8, remaining=4, delay=3)
    assert delayed.finish_step == 7
    assert delayed.new_blocks(3, 4) == 0
    assert delayed.new_blocks(4, 4) == 1


def test_nothing_to_grow_needs_nothing():
    assert peak_new_blocks([], block_size=4) == 0
    assert peak_new_blocks([Growth(slots=8, remaining=0, held=2)], block_size=4) == 0


def _replayed_peak(growths: list[Growth], block_size: int) -> int:
    """Step through time: at step k an unfinished sequence holds its growth so far, a finished
    one has given back what it held and grew."""
    horizon = max((g.finish_step for g in growths), default=0)
    peak = 0
    for step in range(horizon + 1):
        total = 0
        for g in growths:
            if step <= g.finish_step:
                total += g.new_blocks(step, block_size)
            else:
                total -= g.held  # what it grew is gone with it too
        peak = max(peak, total)
    return peak


growths = st.builds(
    Growth,
    slots=st.integers(1, 40),
    remaining=st.integers(0, 40),
    delay=st.integers(0, 4),
    held=st.integers(0, 10),
    copies=st.integers(1, 3),
    copy_on_write=st.integers(0, 2),
)


@given(st.lists(growths, max_size=12), st.sampled_from([1, 3, 4, 16]))
def test_the_projection_equals_a_step_by_step_replay(cases, block_size):
    assert peak_new_blocks(cases, block_size) == _replayed_peak(cases, block_size)


@given(st.lists(growths, min_size=1, max_size=12), st.sampled_from([1, 4, 16]))
def test_the_peak_lies_between_the_largest_single_growth_and_the_sum_of_all(cases, block_size):
    peak = peak_new_blocks(cases, block_size)
    finals = [g.new_blocks(g.finish_step, block_size) for g in cases]
    assert peak <= sum(finals)
    # Each one alone needs its whole growth, and others' growth only adds while they live.
    alone = [peak_new_blocks([g], block_size) for g in cases]
    assert alone == finals
    assert peak >= 0


def test_blocks_for_agrees_with_the_vectorised_rounding():
    # The projection rounds up in numpy; check the corner values against blocks_for.
    for slots in range(0, 9):
        for remaining in range(0, 9):
            g = Growth(slots=slots, remaining=remaining)
            grown = blocks_for(slots + remaining, 4) - blocks_for(slots, 4)
            assert peak_new_blocks([g], 4) == grown
