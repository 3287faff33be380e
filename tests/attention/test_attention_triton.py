"""Triton-specific paths: the split-context (flash-decoding) decode and its merge kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.attention import AttentionMetadata, AttentionOptions, paged_decode_attention
from pagedkv.attention.backends import triton_backend
from pagedkv.kernels import triton_attention

from .cases import DEVICE, assert_close, contiguous_attention, make_case


def _expected(q, case, lens, window=None):
    return torch.stack(
        [
            contiguous_attention(q[b : b + 1], case.keys[b], case.values[b], 0.125, window)[0]
            for b in range(len(lens))
        ]
    )


def test_long_decode_splits_the_context_and_merges_exactly():
    lens = [1, 700, 1500]  # one split, two splits, three splits of MIN_SPLIT_LEN positions
    case = make_case(lens, 16, 2, 64, seed=11)
    q = torch.randn(3, 8, 64).to(DEVICE)
    assert triton_backend.num_splits(6, max(lens), None) == 3  # the interpreter's choice
    for window in (None, 600):  # with a window, the splits before it are empty
        out = paged_decode_attention(
            q, case.layer, case.block_tables, case.context_lens, 0.125, window, backend="triton"
        )
        assert_close(out, _expected(q, case, lens, window), torch.float32)


def test_a_graph_bound_far_above_the_contexts_leaves_empty_splits_that_change_nothing():
    """A CUDA graph decides its splits from max_model_len, not from this step's contexts: each
    sequence divides its own context among them, and the splits left without a position weigh
    nothing in the merge."""
    lens = [5, 130, 1030]
    case = make_case(lens, 16, 2, 32, seed=3)
    q = torch.randn(3, 4, 32).to(DEVICE)
    metadata = AttentionMetadata.for_attention_only(case.block_tables, case.context_lens)
    bounded = dataclasses.replace(metadata, max_seq_len=8 * triton_backend.MIN_SPLIT_LEN)
    if DEVICE.type == "cpu":
        assert triton_backend.num_splits(6, bounded.max_seq_len, None) == 8
    out = triton_backend.decode(q, case.layer, bounded, AttentionOptions(0.125))
    assert_close(out, _expected(q, case, lens), torch.float32)


@pytest.mark.parametrize(
    ("programs", "longest", "multiprocessors", "expected"),
    [
        (8, 100, 132, 1),  # one run of positions: nothing to split
        (8, 4096, 132, 8),  # capped by the context: one split per MIN_SPLIT_LEN positions
        (8, 131072, 132, 33),  # capped by the GPU: ~2 programs per multiprocessor
        (512, 131072, 132, 1),  # a full batch fills the GPU unsplit
        (8, 0, 132, 1),
        (8, 4096, None, 8),  # the interpreter: as far as the context allows
    ],
)
def test_the_split_count_is_a_function_of_host_side_facts(programs, longest, multiprocessors, expected):
    assert triton_backend.num_splits(programs, longest, multiprocessors) == expected


def _merge_reference(acc, maxima, sums, dtype):
    """The log-sum-exp merge in torch ops."""
    weights = torch.exp(maxima - maxima.amax(dim=0, keepdim=True))
    total = (weights * sums).sum(dim=0)
    return ((weights[..., None] * acc).sum(dim=0) / total[..., None]).to(dtype)


@pytest.mark.parametrize(("splits", "dim", "dtype"), [(3, 64, torch.float32), (20, 24, torch.bfloat16)])
def test_the_merge_kernel_equals_the_torch_merge(splits, dim, dtype):
    """Random partials with some empty splits (max -1e30, sum 0, values 0, as the kernel writes
    them); 20 splits take the kernel's loop over split chunks, a head dim of 24 its masked lanes."""
    gen = torch.Generator().manual_seed(splits)
    tokens, heads = 3, 4
    maxima = torch.randn(splits, tokens, heads, generator=gen) * 4
    sums = torch.rand(splits, tokens, heads, generator=gen) + 0.5
    acc = torch.randn(splits, tokens, heads, dim, generator=gen) * sums[..., None]
    empty = torch.rand(splits, tokens, heads, generator=gen) < 0.3
    empty[0] = False  # every row keeps one split with positions
    maxima[empty], sums[empty] = -1.0e30, 0.0
    acc[empty] = 0.0
    partials = [t.to(DEVICE) for t in (acc, maxima, sums)]
    out = triton_attention.merge_splits(*partials, dtype)
    assert out.dtype == dtype and out.shape == (tokens, heads, dim)
    assert_close(out, _merge_reference(acc, maxima, sums, dtype), dtype)


def test_a_row_whose_splits_are_all_empty_merges_to_zeros():
    maxima = torch.full((4, 1, 2), -1.0e30)
    sums = torch.zeros(4, 1, 2)
    acc = torch.zeros(4, 1, 2, 16)
    out = triton_attention.merge_splits(acc.to(DEVICE), maxima.to(DEVICE), sums.to(DEVICE), torch.float32)
    assert torch.equal(out.cpu(), torch.zeros(1, 2, 16))
