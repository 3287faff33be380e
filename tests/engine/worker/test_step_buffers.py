"""Step inputs in one persistent buffer: the views equal the arrays, a layout is a function of the
sizes alone (what a captured graph reads), and the buffer grows only where it may.

On the CPU the same code path runs as on CUDA, with plain tensors in place of pinned staging.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.step_buffers import INT32_FIELDS, INT64_FIELDS, StepBuffers, StepLayout
from pagedkv.engine.worker.step_inputs import pad_decode
from tests.engine.plans import Piece, plan_arrays, plan_of

BS = 4


def _plan(lengths: list[tuple[int, int]], sampled_every: int = 1) -> StepPlan:
    """A slice per ``(start, tokens)``, each with its own blocks; every ``sampled_every``-th one sampled."""
    slices, block = [], 0
    for i, (start, tokens) in enumerate(lengths):
        blocks = -(-(start + tokens) // BS)
        ids = [(7 * i + j) % 50 for j in range(tokens)]
        sampled = i % sampled_every == 0
        slices.append(Piece(ids, start, list(range(block, block + blocks)), sampled, prompt_len=start + 1))
        block += blocks
    return plan_of(slices)


def _assert_views_hold(inputs, arrays) -> None:
    for name in INT64_FIELDS + INT32_FIELDS:
        holder = inputs if name in ("input_ids", "positions", "logits_indices") else inputs.metadata
        view, values = getattr(holder, name), getattr(arrays, name)
        assert view.dtype == (torch.int64 if name in INT64_FIELDS else torch.int32), name
        assert np.array_equal(view.numpy(), values), name


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 9)), min_size=1, max_size=6), st.integers(1, 3))
def test_the_views_read_back_exactly_the_arrays_staged(lengths, sampled_every):
    arrays = plan_arrays(_plan(lengths, sampled_every), BS, 1000)
    buffers = StepBuffers(torch.device("cpu"))
    _assert_views_hold(buffers.stage(arrays), arrays)


def test_fields_never_overlap_and_start_on_a_word():
    layout = StepLayout(num_tokens=5, num_logits=2, num_seqs=3, table_width=7, has_prompt_lens=True)
    taken = np.zeros(layout.words, bool)
    for name, (first, count) in layout.spans.items():
        words = count if name in INT64_FIELDS else -(-count // 2)
        assert not taken[first : first + words].any(), name
        taken[first : first + words] = True
    assert taken.all()  # and leave no gap: the one copy moves no word it need not


def test_a_step_of_the_same_sizes_reads_the_same_addresses_with_its_own_values():
    """What a CUDA graph relies on: its views, made once, read each later step of its size."""
    buffers = StepBuffers(torch.device("cpu"), capacity=256, growable=False)
    first = pad_decode(plan_arrays(_plan([(3, 1), (9, 1)]), BS, 1000), 4, 999, BS, 8)
    inputs = buffers.stage(first)
    later = pad_decode(plan_arrays(_plan([(20, 1), (1, 1), (5, 1)]), BS, 1000), 4, 999, BS, 8)
    assert StepLayout.of(later) == StepLayout.of(first)
    again = buffers.stage(later)
    assert inputs.metadata.block_tables.data_ptr() == again.metadata.block_tables.data_ptr()
    assert inputs.metadata is not again.metadata  # a step's derived kernel arguments are its own
    _assert_views_hold(inputs, later)


def test_a_growable_buffer_makes_room_and_a_fixed_one_refuses():
    small = plan_arrays(_plan([(0, 2)]), BS, 1000)
    large = plan_arrays(_plan([(0, 200), (10, 50)]), BS, 1000)
    growable = StepBuffers(torch.device("cpu"), capacity=StepLayout.of(small).words)
    _assert_views_hold(growable.stage(large), large)
    assert growable.capacity >= StepLayout.of(large).words
    fixed = StepBuffers(torch.device("cpu"), capacity=StepLayout.of(small).words, growable=False)
    with pytest.raises(ValueError, match="of a fixed"):
        fixed.stage(large)
