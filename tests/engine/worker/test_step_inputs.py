"""The host side of a step: the plan's arrays, the CUDA graph batch sizes and the decode padding.

Every shape a step launches with is a pure function of the plan; these tests hold those
functions to their invariants without a device.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.step_buffers import StepLayout
from pagedkv.engine.worker.step_inputs import (
    capture_sizes,
    empty_decode,
    graph_size,
    pad_decode,
    padded_size,
)
from tests.engine.plans import Piece, plan_arrays, plan_of

BS = 4


def _decode_plan(contexts: list[int], first_block: int = 0) -> StepPlan:
    """One decode slice per context length, each with its own run of blocks."""
    slices, block = [], first_block
    for n in contexts:
        blocks = -(-n // BS)
        slices.append(
            Piece([7 + n % 5], n - 1, list(range(block, block + blocks)), True, prompt_len=n // 2 + 1)
        )
        block += blocks
    return plan_of(slices)


def test_a_mixed_plan_becomes_packed_arrays_and_the_facts_that_size_its_launches():
    plan = plan_of(
        [
            Piece([1, 2, 3], 0, [5, 6], True, prompt_len=3),  # a prompt
            Piece([9], 5, [2, 3], True, prompt_len=4),  # a decode at position 5
            Piece([4, 4], 2, [8, 1], False, prompt_len=6),  # a prompt chunk, not sampled
        ]
    )
    arrays = plan_arrays(plan, BS, num_blocks=10)
    assert arrays.input_ids.tolist() == [1, 2, 3, 9, 4, 4]
    assert arrays.positions.tolist() == [0, 1, 2, 5, 2, 3]
    assert arrays.slot_mapping.tolist() == [20, 21, 22, 13, 34, 35]
    assert arrays.logits_indices.tolist() == [2, 3]
    assert arrays.context_lens.tolist() == [3, 6, 4]
    assert arrays.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert arrays.block_tables.tolist() == [[5, 6], [2, 3], [8, 1]]
    assert arrays.prompt_lens.tolist() == [3, 4, 6]
    assert (arrays.max_query_len, arrays.max_seq_len) == (3, 6)
    assert not arrays.samples_every_row


def test_a_table_outside_the_pool_is_refused_naming_the_slice():
    plan = plan_of([Piece([1], 0, [0], True), Piece([1], 4, [1, 10], True)])
    with pytest.raises(ValueError, match="slice 1 computes positions 4..4"):
        plan_arrays(plan, BS, num_blocks=10)


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [(1, (1,)), (3, (1, 2, 3)), (48, (1, 2, 4, 8, 16, 32, 48)), (64, (1, 2, 4, 8, 16, 32, 64))],
)
def test_graphs_are_captured_for_powers_of_two_up_to_max_num_seqs(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


@given(st.integers(1, 600))
def test_every_batch_the_scheduler_forms_has_a_graph_at_most_twice_its_size(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert list(sizes) == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    for batch in range(1, max_num_seqs + 1):
        size = padded_size(batch, sizes)
        assert batch <= size < 2 * batch or size == batch
    assert padded_size(max_num_seqs + 1, sizes) is None


def test_only_a_decode_step_that_a_graph_holds_replays_one():
    sizes, width = (1, 2, 4), 4  # tables of 4 blocks: contexts up to 16 tokens
    assert graph_size(plan_arrays(_decode_plan([5, 9, 3]), BS, 100), sizes, BS, width) == 4
    assert graph_size(plan_arrays(_decode_plan([16]), BS, 100), sizes, BS, width) == 1
    too_long = plan_arrays(_decode_plan([17]), BS, 100)
    too_many = plan_arrays(_decode_plan([2] * 5), BS, 100)
    prefill = plan_arrays(plan_of([Piece([1, 2], 0, [0], True, prompt_len=2)]), BS, 100)
    unsampled = plan_arrays(plan_of([Piece([1], 3, [0], False, prompt_len=9)]), BS, 100)
    no_prompt_len = plan_arrays(plan_of([Piece([1], 3, [0], True)]), BS, 100)
    for arrays in (too_long, too_many, prefill, unsampled, no_prompt_len):
        assert graph_size(arrays, sizes, BS, width) is None


@settings(max_examples=200, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 40), min_size=0, max_size=8),
    extra=st.integers(0, 8),
    spare_columns=st.integers(0, 3),
)
def test_padding_rows_touch_only_the_scratch_block_and_leave_the_real_rows_as_they_were(
    contexts, extra, spare_columns
):
    """Padded to any size, with tables narrower or wider than the graph's, the real rows keep
    their ids, positions, slots, contexts and the blocks their contexts read; each padding row
    is one token at position 0 in slot 0 of the scratch block, reading only that block; and
    the layout is the one the graph of that size was captured with."""
    width, scratch = 10, 999  # contexts up to 40 tokens in 10 blocks of 4
    size = len(contexts) + extra
    if size == 0:
        return
    plan = _decode_plan(contexts)
    if contexts and spare_columns:  # tables may run past the context (a lookahead block)
        plan = plan_of(
            [
                Piece(
                    s.token_ids, s.start, e.new_block_ids + [3] * spare_columns, True, prompt_len=s.prompt_len
                )
                for s, e in zip(plan.slices, plan.table_edits, strict=True)
            ]
        )
    arrays = plan_arrays(plan, BS, 1000) if contexts else empty_decode()
    padded = pad_decode(arrays, size, scratch, BS, width)
    real = len(contexts)
    for name in ("input_ids", "positions", "slot_mapping", "context_lens", "prompt_lens"):
        assert np.array_equal(getattr(padded, name)[:real], getattr(arrays, name)), name
    for row, n in enumerate(contexts):
        read = -(-n // BS)
        assert np.array_equal(padded.block_tables[row, :read], arrays.block_tables[row, :read])
    assert padded.slot_mapping[real:].tolist() == [scratch * BS] * extra
    assert padded.positions[real:].tolist() == [0] * extra
    assert padded.context_lens[real:].tolist() == [1] * extra
    assert (padded.block_tables[real:] == scratch).all()
    assert scratch * BS not in arrays.slot_mapping.tolist()
    assert padded.cu_seqlens_q.tolist() == list(range(size + 1))
    assert padded.logits_indices.tolist() == list(range(size))
    assert padded.block_tables.shape == (size, width)
    assert StepLayout.of(padded) == StepLayout.of(pad_decode(empty_decode(), size, scratch, BS, width))


def test_padding_refuses_what_is_not_a_decode_step_of_at_most_the_size():
    arrays = plan_arrays(_decode_plan([3, 4, 5]), BS, 100)
    with pytest.raises(ValueError, match="at most 2 sequences"):
        pad_decode(arrays, 2, 99, BS, 4)
    prefill = plan_arrays(plan_of([Piece([1, 2], 0, [0], True, prompt_len=2)]), BS, 100)
    with pytest.raises(ValueError, match="longest query of 2"):
        pad_decode(prefill, 4, 99, BS, 4)
