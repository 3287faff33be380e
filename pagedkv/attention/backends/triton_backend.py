"""The ``triton`` backend: the default for CUDA tensors.

On a GPU the kernel in :mod:`pagedkv.kernels.triton_attention` is compiled by Triton;
for CPU tensors it runs in Triton's interpreter, which is how the test suite checks the very
same kernel code without a GPU (slow: use small shapes).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from pagedkv.attention.kv_cache import LayerKV
from pagedkv.attention.metadata import AttentionMetadata, AttentionOptions

#: blocks of every cache dtype: the kernel reads quantized ones in place
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
#: the longest context is split into runs of at least this many positions
MIN_SPLIT_LEN = 512


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits(programs: int, longest: int, multiprocessors: int | None) -> int:
    """Decode only: into how many runs the kernel splits each context, from host-side facts
    alone (the step plan's longest context or a CUDA graph's bound, and ``programs`` launched
    per split): enough to give the GPU's ``multiprocessors`` ~2 programs each, at most one per
    :data:`MIN_SPLIT_LEN` positions of ``longest``. The interpreter (None) splits every long
    context as far as that allows, so the tests exercise the merge."""
    most = _cdiv(longest, MIN_SPLIT_LEN)
    if multiprocessors is None:
        return max(1, most)
    return max(1, min(most, _cdiv(2 * multiprocessors, programs)))


def prefill(q: Tensor, layer: LayerKV, metadata: AttentionMetadata, options: AttentionOptions) -> Tensor:
    try:
        from pagedkv.kernels import triton_attention, triton_launch
    except ImportError as exc:  # pragma: no cover - triton is a declared test dependency
        raise RuntimeError("the triton attention backend needs `pip install triton`") from exc
    interpret = q.device.type != "cuda"
    block_tables, context_lens = metadata.block_tables, metadata.context_lens
    max_query_len = metadata.max_query_len
    sliding_window, soft_cap = options.sliding_window, options.soft_cap
    kernel = triton_attention.kernel_for(interpret)
    num_seqs, num_tokens, num_heads = block_tables.shape[0], q.shape[0], q.shape[1]
    group = num_heads // layer.num_kv_heads
    block_g = _next_pow2(group)
    # a tile of at least 16 query rows (tl.dot's minimum), up to 64 for prefill. The interpreter
    # pays per operation, not per element, so it gets the largest tiles.
    rows = 16 if max_query_len == 1 else (128 if interpret else 64)
    block_m = max(1, rows // block_g)
    block_d = max(16, _next_pow2(layer.head_dim))
    block_n = 256 if interpret else (64 if layer.head_dim <= 128 else 32)
    key, value = layer.key, layer.value
    if key.stride() != value.stride() or key.stride(-1) != 1:
        raise ValueError("the triton backend needs key and value pools with the same contiguous layout")
    fp8 = key.dtype == torch.float8_e4m3fn
    key_scale, value_scale = (layer.key_scale, layer.value_scale) if layer.quantized else (key, value)
    if layer.quantized and not key.is_contiguous():  # the kernel derives scale offsets from element ones
        raise ValueError("the triton backend needs contiguous quantized pools")
    if fp8:  # read as raw bytes: the kernel converts them itself, on any GPU and in the interpreter
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    q = q.contiguous()
    m_tiles = _cdiv(max_query_len, block_m)
    splits = 1
    if max_query_len == 1:
        multiprocessors = (
            None if interpret else torch.cuda.get_device_properties(q.device).multi_processor_count
        )
        splits = num_splits(num_seqs * layer.num_kv_heads, metadata.longest_context(), multiprocessors)
    if splits > 1:
        out = torch.empty(
            (splits, num_tokens, num_heads, layer.head_dim), dtype=torch.float32, device=q.device
        )
        maxima = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxima)
    else:
        out = torch.empty_like(q)
        maxima = sums = out  # unused
    grid = (m_tiles * splits, num_seqs, layer.num_kv_heads)
    scope = triton_launch.interpreted_device_calls() if interpret else contextlib.nullcontext()
    with scope:
        kernel[grid](
            q,
            key,
            value,
            key_scale,
            value_scale,
            out,
            maxima,
            sums,
            block_tables.to(torch.int32).contiguous(),
            metadata.cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous(),
            context_lens.to(torch.int32).contiguous(),
            options.scale,
            float(soft_cap or 1.0),
            int(sliding_window or 0),
            splits,
            q.stride(0),
            q.stride(1),
            key.stride(0),
            key.stride(1),
            key.stride(2),
            block_tables.shape[1],
            num_tokens,
            GROUP=group,
            NUM_HEADS=num_heads,
            HEAD_DIM=layer.head_dim,
            BLOCK_SIZE=layer.block_size,
            BLOCK_M=block_m,
            BLOCK_G=block_g,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            USE_WINDOW=sliding_window is not None,
            USE_SOFT_CAP=soft_cap is not None,
            DOT_FP32=q.dtype == torch.float32 or (interpret and q.dtype == torch.bfloat16),
            SPLIT=splits > 1,
            QUANT=layer.quantized,
            FP8=fp8,
        )
    if splits > 1:
        return triton_attention.merge_splits(out, maxima, sums, q.dtype)
    return out


#: One kernel serves both: a decode step is a prefill step whose query runs are one token long.
decode = prefill
