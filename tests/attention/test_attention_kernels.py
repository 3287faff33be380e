"""Every backend agrees with contiguous attention over un-paged K/V.

The grid the issue asks for: block sizes 1/8/16/32, GQA ratios 1/4/8, head dims 64/80/128,
context lengths 1, block boundary - 1, boundary, boundary + 1 and a few thousand, shuffled
physical blocks, NaN in every slot never written.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.attention import paged_decode_attention, paged_prefill_attention

from .cases import BACKENDS, DEVICE, assert_close, contiguous_attention, make_case

GRID = list(itertools.product([1, 8, 16, 32], [1, 4, 8]))
HEAD_DIMS = [64, 80, 128]
KV_HEADS = 2
LONG = 2100


def boundary_lens(block_size: int, long: int = LONG) -> list[int]:
    return sorted({1, max(block_size - 1, 1), block_size, block_size + 1, long})


def run_decode(case, num_heads, scale, backend, window=None, cap=None, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(case.keys), num_heads, case.layer.head_dim, generator=gen).to(DEVICE, dtype)
    out = paged_decode_attention(
        q, case.layer, case.block_tables, case.context_lens, scale, window, cap, backend=backend
    )
    expected = torch.stack(
        [
            contiguous_attention(q[b : b + 1], case.keys[b], case.values[b], scale, window, cap)[0]
            for b in range(len(case.keys))
        ]
    )
    return out, expected


def run_prefill(case, q_lens, num_heads, scale, backend, window=None, cap=None, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), num_heads, case.layer.head_dim, generator=gen).to(DEVICE, dtype)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(
        q, case.layer, case.block_tables, cu, case.context_lens, scale, window, cap, backend=backend
    )
    expected = torch.cat(
        [
            contiguous_attention(q[cu[b] : cu[b + 1]], case.keys[b], case.values[b], scale, window, cap)
            for b in range(len(q_lens))
        ]
    )
    return out, expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", range(len(GRID)), ids=lambda i: "bs{}-gqa{}".format(*GRID[i]))
def test_decode_matches_contiguous(backend, index):
    block_size, gqa = GRID[index]
    head_dim = HEAD_DIMS[(index // 3 + index) % 3]  # every GQA ratio meets every head dim
    # the slow interpreter takes a shorter long context (its splits have their own tests)
    long = 600 if backend == "triton" and DEVICE.type == "cpu" else LONG
    case = make_case(boundary_lens(block_size, long), block_size, KV_HEADS, head_dim, seed=index)
    out, expected = run_decode(case, KV_HEADS * gqa, head_dim**-0.5, backend)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", range(len(GRID)), ids=lambda i: "bs{}-gqa{}".format(*GRID[i]))
def test_prefill_with_and_without_cached_prefix(backend, index):
    block_size, gqa = GRID[index]
    head_dim = HEAD_DIMS[(index // 3 + index + 1) % 3]
    interpreted = backend == "triton" and DEVICE.type == "cpu"  # slow: smaller lengths
    medium, long = (96, 400) if interpreted else (300, LONG)
    lens = boundary_lens(block_size, long=medium) + [long]
    # boundary lengths alternate: the whole context is new (no prefix) / only its tail is new
    # (a prefix-cache hit or a later chunk); `medium` new tokens with no prefix; 37 new tokens
    # after a long cached prefix.
    q_lens = [n if i % 2 == 0 else max(1, n // 3) for i, n in enumerate(lens[:-2])] + [medium, 37]
    case = make_case(lens, block_size, KV_HEADS, head_dim, seed=index)
    out, expected = run_prefill(case, q_lens, KV_HEADS * gqa, head_dim**-0.5, backend)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(backend, dtype):
    case = make_case([1, 15, 16, 17, 600], 16, KV_HEADS, 80, dtype=dtype, seed=3)
    out, expected = run_decode(case, KV_HEADS * 4, 80**-0.5, backend, dtype=dtype)
    assert_close(out, expected, dtype)
    out, expected = run_prefill(case, [1, 15, 5, 17, 100], KV_HEADS * 4, 80**-0.5, backend, dtype=dtype)
    assert_close(out, expected, dtype)


WINDOW_CAP = [(1, None), (7, None), (19, None), (None, 2.0), (9, 1.5)]
INTERPRETED_WINDOW_CAP = [(7, None), (None, 2.0), (9, 1.5)]  # the slow interpreter: a subset


@pytest.mark.parametrize(
    "backend,window,cap",
    [
        (backend, window, cap)
        for backend in BACKENDS
        for window, cap in WINDOW_CAP
        if backend != "triton" or DEVICE.type != "cpu" or (window, cap) in INTERPRETED_WINDOW_CAP
    ],
)
def test_sliding_window_and_soft_cap(backend, window, cap):
    case = make_case([1, 6, 8, 9, 40, 123], 8, KV_HEADS, 64, seed=5)
    out, expected = run_decode(case, KV_HEADS * 4, 0.5, backend, window, cap)
    assert_close(out, expected, torch.float32)
    out, expected = run_prefill(case, [1, 6, 3, 9, 40, 100], KV_HEADS * 4, 0.5, backend, window, cap)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_prefill_property(backend, data):
    block_size = data.draw(st.sampled_from([1, 2, 8, 16, 32]), label="block_size")
    gqa = data.draw(st.sampled_from([1, 2, 4, 8]), label="gqa")
    head_dim = data.draw(st.sampled_from([16, 64, 80]), label="head_dim")
    lens = data.draw(st.lists(st.integers(1, 90), min_size=1, max_size=5), label="context_lens")
    q_lens = [data.draw(st.integers(1, n), label="q_len") for n in lens]
    window = data.draw(st.none() | st.integers(1, 100), label="window")
    cap = data.draw(st.none() | st.floats(0.5, 50.0), label="soft_cap")
    case = make_case(lens, block_size, 1, head_dim, seed=data.draw(st.integers(0, 2**16), label="seed"))
    out, expected = run_prefill(case, q_lens, gqa, head_dim**-0.5, backend, window, cap)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_never_written_are_never_read(backend):
    """Every slot write_kv did not fill holds NaN (the tails of last blocks, spare blocks, the
    blocks that padding columns of the table point to); one read of any would poison the row."""
    case = make_case([3, 8, 13], 8, KV_HEADS, 16, spare_blocks=4, spare_columns=3)
    assert torch.isnan(case.layer.key).any() and torch.isnan(case.layer.value).any()
    out, expected = run_decode(case, KV_HEADS * 2, 0.25, backend)
    assert torch.isfinite(out).all()
    assert_close(out, expected, torch.float32)
    out, expected = run_prefill(case, [3, 2, 13], KV_HEADS * 2, 0.25, backend)
    assert torch.isfinite(out).all()
    assert_close(out, expected, torch.float32)
