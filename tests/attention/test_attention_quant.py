"""Quantized KV blocks (fp8 e4m3, int8): the quantizer's error bounds, and every backend that
reads them against the torch reference on the same quantized pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pagedkv.attention import (
    KVCache,
    check_backend_reads,
    copy_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from pagedkv.attention.backends import BACKENDS, Backend, cpu, torch_backend
from pagedkv.attention.quant import MIN_SCALE, QMAX, check_kv_cache_dtype, dequantize, quantize
from pagedkv.memory.kv_bytes import KVSpec

from .cases import DEVICE, contiguous_attention, make_case

QUANTIZED = ["fp8", "int8"]
FINITE = st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False, width=32)


@settings(max_examples=200, deadline=None)
@given(arrays("float32", st.tuples(st.integers(1, 4), st.integers(1, 80)), elements=FINITE))
def test_int8_round_trip_is_within_half_a_step(x):
    x = torch.from_numpy(x)
    stored, scale = quantize(x, torch.int8)
    assert stored.dtype == torch.int8 and scale.shape == x.shape[:-1]
    back = dequantize(stored, scale)
    # one step is the scale, amax / 127 (rows under 127 * MIN_SCALE round to zero): rounding is
    # off by at most half a step (float32 slack on top)
    amax = x.abs().amax(dim=-1)
    torch.testing.assert_close(scale, (amax / 127).clamp(min=MIN_SCALE))
    bound = scale.unsqueeze(-1) / 2 * (1 + 1e-5)
    assert bool(((back - x).abs() <= bound).all())
    assert bool((stored.abs() <= 127).all())


@settings(max_examples=200, deadline=None)
@given(arrays("float32", st.tuples(st.integers(1, 4), st.integers(1, 80)), elements=FINITE))
def test_fp8_round_trip_is_within_half_an_ulp(x):
    x = torch.from_numpy(x)
    stored, scale = quantize(x, torch.float8_e4m3fn)
    back = dequantize(stored, scale)
    assert bool(torch.isfinite(back).all())
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4; below its smallest normal
    # (2^-6 of the scale) the step is the subnormal one, 2^-9, so the error is at most 2^-10
    bound = torch.maximum(x.abs() * 2**-4, scale.unsqueeze(-1) * 2**-10) * (1 + 1e-5) + 1e-30
    assert bool(((back - x).abs() <= bound).all())
    # the largest magnitude of every row lands on the type's largest value (rows of magnitudes
    # below the smallest scale times 448, under 5e-10, are stored as zeros)
    top = stored.float().abs().amax(dim=-1)
    tiny = x.abs().amax(dim=-1) < MIN_SCALE * QMAX[torch.float8_e4m3fn]
    assert bool(((top == QMAX[torch.float8_e4m3fn]) | tiny).all())


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_zero_head_stays_zero(kv_cache_dtype):
    dtype = check_kv_cache_dtype(kv_cache_dtype)
    stored, scale = quantize(torch.zeros(3, 2, 8), dtype)
    assert bool((dequantize(stored, scale) == 0).all()) and bool((scale > 0).all())


def _decode_all(case, q, backend, scale=0.25, window=None, soft_cap=None):
    return paged_decode_attention(
        q, case.layer, case.block_tables, case.context_lens, scale, window, soft_cap, backend=backend
    )


def _dequantized_context(case, b):
    """Sequence ``b``'s keys and values as the quantized pool holds them."""
    return torch_backend.gather_context(case.layer, case.block_tables[b], int(case.context_lens[b]))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_equals_the_reference_on_quantized_blocks(kv_cache_dtype, block_size, dtype):
    lens = [1, 7, 16, 33, 70]  # ragged: partial last blocks, a one-token context
    case = make_case(lens, block_size, 2, 32, dtype, seed=3, kv_cache_dtype=kv_cache_dtype, device="cpu")
    assert case.layer.key.dtype == check_kv_cache_dtype(kv_cache_dtype)
    q = torch.randn(len(lens), 8, 32).to(dtype)  # GQA: 4 query heads per KV head
    for window, soft_cap in ((None, None), (9, None), (None, 5.0)):
        out = _decode_all(case, q, "cpu", window=window, soft_cap=soft_cap)
        expected = _decode_all(case, q, "torch", window=window, soft_cap=soft_cap)
        assert out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    # and the reference is contiguous attention over the dequantized keys and values
    expected = _decode_all(case, q, "torch")
    for b in range(len(lens)):
        key, value = _dequantized_context(case, b)
        want = contiguous_attention(q[b : b + 1].float(), key, value, 0.25)[0]
        torch.testing.assert_close(expected[b].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize(("heads", "kv_heads"), [(3, 3), (6, 2), (12, 2)])
def test_cpu_decode_with_any_group_size(kv_cache_dtype, heads, kv_heads):
    """The kernel scores up to four query heads per converted key: groups of 1, 3 and 6 heads
    (a partial batch of four) give the reference's result too."""
    case = make_case([5, 37], 16, kv_heads, 24, seed=13, kv_cache_dtype=kv_cache_dtype, device="cpu")
    q = torch.randn(2, heads, 24)
    torch.testing.assert_close(
        _decode_all(case, q, "cpu"), _decode_all(case, q, "torch"), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_equals_the_reference_on_quantized_blocks(backend, kv_cache_dtype, block_size):
    lens = [5, 40, 19]
    device = DEVICE if backend == "triton" else "cpu"  # benchmarks/gpu_check.sh: triton on the GPU
    case = make_case(lens, block_size, 1, 16, seed=5, kv_cache_dtype=kv_cache_dtype, device=device)
    q_lens = [5, 12, 1]  # a whole prompt, a chunk after a cached prefix, one decode row
    cu = torch.tensor([0, 5, 17, 18], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), 4, 16).to(device)
    args = (q, case.layer, case.block_tables, cu, case.context_lens, 0.3)
    out = paged_prefill_attention(*args, backend=backend)
    torch.testing.assert_close(out, paged_prefill_attention(*args, backend="torch"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("block_size", [1, 16])
def test_triton_decode_equals_the_reference_on_quantized_blocks(kv_cache_dtype, block_size):
    """Under Triton's CPU interpreter (compiled on the GPU by ``benchmarks/gpu_check.sh``): GQA,
    ragged lengths, a window, a soft-cap, and a context long enough to be split and merged."""
    lens = [1, 9, 600]
    case = make_case(lens, block_size, 2, 16, seed=9, kv_cache_dtype=kv_cache_dtype)  # on DEVICE
    q = torch.randn(len(lens), 4, 16).to(DEVICE)
    for window, soft_cap in ((None, None), (7, 4.0)):
        out = _decode_all(case, q, "triton", window=window, soft_cap=soft_cap)
        expected = _decode_all(case, q, "torch", window=window, soft_cap=soft_cap)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_cpu_long_prompt_sdpa_path_dequantizes(kv_cache_dtype):
    """Query runs longer than the native kernel takes go through gather + SDPA: the gather
    dequantizes into the query's dtype."""
    n = cpu.NATIVE_MAX_QUERY_LEN + 8
    case = make_case([n], 16, 1, 8, seed=2, kv_cache_dtype=kv_cache_dtype, device="cpu")
    q = torch.randn(n, 2, 8)
    cu = torch.tensor([0, n], dtype=torch.int32)
    args = (q, case.layer, case.block_tables, cu, case.context_lens, 0.3)
    out = paged_prefill_attention(*args, backend="cpu")
    torch.testing.assert_close(out, paged_prefill_attention(*args, backend="torch"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_quantized_attention_stays_close_to_unquantized(kv_cache_dtype):
    """What quantization costs on random data: the output moves by a few percent at most."""
    lens = [64, 200]
    quant = make_case(lens, 16, 2, 64, seed=7, kv_cache_dtype=kv_cache_dtype, device="cpu")
    exact = make_case(lens, 16, 2, 64, seed=7, device="cpu")
    q = torch.randn(2, 4, 64)
    diff = (_decode_all(quant, q, "cpu", 0.125) - _decode_all(exact, q, "cpu", 0.125)).abs().max()
    assert float(diff) < (0.05 if kv_cache_dtype == "fp8" else 0.01)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_copy_on_write_copies_the_scales(kv_cache_dtype):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
    cache = KVCache(spec, 4, 4, torch.float32, kv_cache_dtype=kv_cache_dtype)
    keys = torch.randn(4, 2, 8) * torch.tensor([1.0, 100.0]).view(1, 2, 1)  # heads of different size
    for layer in cache.layers:
        write_kv(keys, -keys, layer, torch.arange(4, 8))  # block 1
    copy_blocks(cache, [(1, 3)])
    for layer in cache.layers:
        table = torch.tensor([3], dtype=torch.int32)
        key, value = torch_backend.gather_context(layer, table, 4)
        src_key, _ = torch_backend.gather_context(layer, torch.tensor([1], dtype=torch.int32), 4)
        assert torch.equal(key, src_key)
        torch.testing.assert_close(value, -keys, atol=0.07 * 100, rtol=0.07)


def test_sizes_count_the_scales():
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    auto = KVCache(spec, 8, 16, torch.float32)
    fp8 = KVCache(spec, 8, 16, torch.float32, kv_cache_dtype="fp8")
    assert fp8.spec.bytes_per_token == 2 * 2 * 4 * (64 + 4)  # one byte per element, a float32 scale
    assert auto.spec.bytes_per_token == 2 * 2 * 4 * 64 * 4
    assert fp8.nbytes == fp8.spec.bytes_per_block(16) * 8
    assert KVCache.from_memory(spec, auto.nbytes, 16, torch.float32, kv_cache_dtype="int8").num_blocks == 30


def test_bad_kv_cache_dtypes_are_refused_with_the_choices(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype 'fp4'.*'auto', 'fp8', 'int8'"):
        check_backend_reads(None, "cpu", "fp4")
    for name in ("torch", "cpu", "triton"):
        assert check_backend_reads(name, "cpu", "fp8").name == name
    # a backend that reads only unquantized blocks is named, with the ones that would do
    reference = BACKENDS["torch"]
    monkeypatch.setitem(BACKENDS, "plain", Backend("plain", reference.decode, reference.prefill, ("auto",)))
    with pytest.raises(ValueError, match=r"'plain' attention backend cannot read kv_cache_dtype='int8'"):
        check_backend_reads("plain", "cpu", "int8")
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        KVCache(spec, 2, 4, torch.float32, kv_cache_dtype="float8")
