"""Applying a bitmask: forbidden tokens of constrained rows go to -inf, nothing else moves a bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.engine.structured.bitmask import (
    allocate_token_bitmask,
    allows_only,
    apply_token_bitmask,
    bitmask_width,
    fill_token_bitmask,
)
from tests.engine.structured.walks import allowed_tokens

#: Values whose bits a careless mask could change: signed zeros, infinities, NaN, subnormals.
SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3.5]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 6),
    vocab=st.sampled_from([1, 2, 3, 7, 8, 12, 31, 32, 33, 100, 2048, 2049]),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_only_the_forbidden_tokens_of_the_constrained_rows_change(batch, vocab, seed, data):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch + 1, vocab, generator=gen) * 10
    specials = torch.tensor(SPECIAL)[torch.randint(len(SPECIAL), (batch + 1, vocab), generator=gen)]
    memory = torch.where(torch.rand(batch + 1, vocab, generator=gen) < 0.2, specials, values)
    logits = memory[:batch]  # the last row of memory guards against writes past the tensor
    bitmask = torch.randint(-(2**31), 2**31, (batch, bitmask_width(vocab)), generator=gen, dtype=torch.int32)
    rows = sorted(data.draw(st.sets(st.integers(0, batch - 1)), label="constrained rows"))
    before = memory.clone()

    apply_token_bitmask(logits, bitmask, rows)

    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    expected = before
    for row in rows:
        expected[row, torch.from_numpy(~allowed[row])] = float("-inf")
    assert torch.equal(bits(memory), bits(expected))


def test_no_constrained_row_changes_nothing():
    logits = torch.randn(3, 64)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(3, 2, dtype=torch.int32), [])
    assert torch.equal(bits(logits), bits(before))


def test_a_bitmask_of_the_wrong_width_is_refused():
    with pytest.raises(
        ValueError, match=r"a bitmask of shape \(2, 3\) does not cover logits of shape \(2, 64\)"
    ):
        apply_token_bitmask(torch.randn(2, 64), allocate_token_bitmask(2, 96), [0])


def test_fill_writes_the_constrained_rows_only(compiler, tokenizer, vocab_size):
    matcher = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).matcher()
    bitmask = allocate_token_bitmask(3, vocab_size)
    assert fill_token_bitmask(bitmask, [None, matcher, None]) == [1]
    assert torch.equal(bitmask[[0, 2]], torch.full((2, bitmask_width(vocab_size)), -1, dtype=torch.int32))
    firsts = {tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no")}
    assert firsts <= set(allowed_tokens(bitmask[1], vocab_size))
    assert not set(allowed_tokens(bitmask[1], vocab_size)) & tokenizer.eos_token_ids

    logits = torch.randn(3, vocab_size)
    before = logits.clone()
    apply_token_bitmask(logits, bitmask, [1])
    assert torch.equal(bits(logits[[0, 2]]), bits(before[[0, 2]]))
    kept = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert kept == allowed_tokens(bitmask[1], vocab_size)


@pytest.mark.parametrize("rows", [[-1], [2], [0, 5]])
def test_rows_outside_the_batch_are_refused(rows):
    with pytest.raises(ValueError, match="are not all rows"):
        apply_token_bitmask(torch.randn(2, 64), allocate_token_bitmask(2, 64), rows)


@pytest.mark.parametrize("vocab", [33, 64, 70])
def test_allows_only_reads_the_vocabulary_bits_and_nothing_past_them(vocab):
    bitmask = torch.zeros(2, bitmask_width(vocab), dtype=torch.int32)
    words = bitmask[1].numpy().view(np.uint32)
    for token in (1, 31, vocab - 1):
        words[token // 32] |= np.uint32(1 << (token % 32))
    if vocab % 32:
        words[-1] |= np.uint32(1 << 31)  # a bit past the vocabulary: means nothing
    assert allows_only(bitmask, 1, {1, 31, vocab - 1}, vocab)
    assert allows_only(bitmask, 1, {1, 31, vocab - 1, 5}, vocab)
    assert not allows_only(bitmask, 1, {1, 31}, vocab)
    assert allows_only(bitmask, 0, set(), vocab)  # nothing allowed at all
