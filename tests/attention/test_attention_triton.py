"""Triton-specific paths: the split-context (flash-decoding) decode and its merge."""

from __future__ import annotations

import torch

from pagedkv.attention import paged_decode_attention
from pagedkv.attention.backends import triton_backend

from .cases import DEVICE, assert_close, contiguous_attention, make_case


def test_long_decode_splits_the_context_and_merges_exactly():
    lens = [1, 700, 1500]  # one split, two splits, three splits of MIN_SPLIT_LEN positions
    case = make_case(lens, 16, 2, 64, seed=11)
    q = torch.randn(3, 8, 64).to(DEVICE)
    if DEVICE.type == "cpu":  # the interpreter splits every context longer than one split
        assert triton_backend.num_splits(q, 6, max(lens), interpret=True) == 3
    for window in (None, 600):  # with a window, the splits before it are empty
        out = paged_decode_attention(
            q, case.layer, case.block_tables, case.context_lens, 0.125, window, backend="triton"
        )
        expected = torch.stack(
            [
                contiguous_attention(q[b : b + 1], case.keys[b], case.values[b], 0.125, window)[0]
                for b in range(3)
            ]
        )
        assert_close(out, expected, torch.float32)
