"""The Triton paged-attention kernel (one kernel for decode and prefill).

A program owns ``BLOCK_M`` consecutive query positions of one sequence and the ``G = Hq / Hkv``
query heads that share one KV head: its tile of ``BLOCK_M * BLOCK_G`` query rows is multiplied
against tiles of ``BLOCK_N`` context positions whose keys and values are loaded *through the
block table* (physical block = table[pos // block_size], slot = pos % block_size), with an
online softmax (flash-attention style) in float32. Loads are masked to the positions a query
may see (causal, sliding window, inside the context), so slots never written are never read.
Decode is the case ``BLOCK_M = 1`` with one query per sequence.

Split context (flash-decoding): with ``num_splits > 1`` the programs of one query tile share the
positions it may see, each ``num_splits``-th of them in whole ``BLOCK_N`` tiles, and write an
un-normalised partial (running max, sum of exponentials, weighted values) instead of the output;
:func:`merge_splits` combines them in one more kernel. A decode batch of a few long sequences
then fills the GPU instead of launching B * Hkv programs. Each sequence's share is computed in
the kernel from its own context length, so the launch depends on no device value: the host
picks ``num_splits`` from what it knows (the step plan's longest context, or a CUDA graph's
bound), and a split that gets no position writes an empty partial (max -1e30, sum 0) that the
merge weighs zero.

Quantized pools (``QUANT``): keys and values arrive as one byte per element (fp8 e4m3 as raw
uint8, int8) and become floats in registers -- fp8 by moving its bits into a float32's exponent
and mantissa and multiplying by 2^120 (the bias difference), so no fp8 hardware type is needed
on any GPU or in the interpreter. Each position's float32 key scale multiplies its score column;
its value scale multiplies its softmax weight before the second product (the row sums use the
unscaled weights). Scales are ``[num_blocks, block_size, Hkv]``, so with contiguous pools a
scale's offset is its element offset divided by ``HEAD_DIM``.

``DOT_FP32`` makes both matrix products exact float32 (no TF32): always for float32 caches,
whose results must match SDPA to 1e-5, and for bfloat16 under the interpreter, whose ``tl.dot``
mishandles bfloat16.

This module imports triton; :mod:`pagedkv.attention.backends.triton_backend` imports it lazily.
The kernel bodies are plain functions, jitted for CUDA tensors and interpreted for CPU ones at
first use (:mod:`pagedkv.kernels.triton_launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_launch import jitted, launch


@triton.jit
def stored_to_float(x, FP8: tl.constexpr):
    """One-byte elements as float32: int8 by conversion; fp8 e4m3 (raw uint8) placed at a
    float32's exponent/mantissa boundary, which reads as the value times 2^-120."""
    if FP8:
        bits = x.to(tl.uint32)
        x = (((bits & 0x7F) << 20) | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)
        x = x * 1.329227995784916e36  # 2^120: e4m3's exponent bias is 7, float32's 127
    return x.to(tl.float32)


def paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    k_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (QUANT only)
    v_scale_ptr,
    out_ptr,  # [T, Hq, D], or [num_splits, T, Hq, D] float32 partial sums when SPLIT
    max_ptr,  # [num_splits, T, Hq] float32 partial maxima (SPLIT only)
    sum_ptr,  # [num_splits, T, Hq] float32 partial sums of exponentials (SPLIT only)
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    scale,
    soft_cap,
    window,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_table,
    num_tokens,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    QUANT: tl.constexpr,
    FP8: tl.constexpr,
):
    m_tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    m_idx = m_tile * BLOCK_M + rows // BLOCK_G  # query index inside the sequence
    g_idx = rows % BLOCK_G
    row_valid = (m_idx < q_len) & (g_idx < GROUP)
    q_pos = context_len - q_len + m_idx  # absolute position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    head = kv_head * GROUP + g_idx
    q_offs = (q_start + m_idx).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # the context range any row of this tile may see, cut to this program's split
    last_pos = tl.minimum(context_len - q_len + m_tile * BLOCK_M + BLOCK_M, context_len) - 1
    first_pos = 0
    if USE_WINDOW:
        first_pos = tl.maximum(context_len - q_len + m_tile * BLOCK_M - window + 1, 0)
    lo = (first_pos // BLOCK_N) * BLOCK_N
    hi = last_pos + 1
    if SPLIT:  # this program's share: whole tiles, so every split starts on a tile boundary
        split_len = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * split_len
        hi = tl.minimum(hi, lo + split_len)

    m_i = tl.full([BLOCK_M * BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_valid = (pos < hi) & (pos >= first_pos)
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        kv_offs = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = pos_valid[:, None] & d_valid[None, :]
        k = tl.load(k_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0)
        if QUANT:
            k = stored_to_float(k, FP8).to(q.dtype)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if QUANT:
            k_scale = tl.load(k_scale_ptr + kv_offs // HEAD_DIM, mask=pos_valid, other=0.0)
            s = s * k_scale[None, :]
        if USE_SOFT_CAP:
            # cap * tanh(s / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        allowed = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0)
        if QUANT:
            v = stored_to_float(v, FP8).to(q.dtype)
            p = p * tl.load(v_scale_ptr + kv_offs // HEAD_DIM, mask=pos_valid, other=0.0)[None, :]
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # output rows [T, Hq] (times the split's [T, Hq] slab when SPLIT)
    row_offs = (split * num_tokens + q_start + m_idx).to(tl.int64) * NUM_HEADS + head
    out_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT:
        tl.store(max_ptr + row_offs, m_i, mask=row_valid)
        tl.store(sum_ptr + row_offs, l_i, mask=row_valid)
        tl.store(out_ptr + row_offs[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_offs = row_offs[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def merge_splits_kernel(
    acc_ptr,  # [num_splits, rows, HEAD_DIM] float32 partial sums of weighted values
    max_ptr,  # [num_splits, rows] float32 partial maxima
    sum_ptr,  # [num_splits, rows] float32 partial sums of exponentials
    out_ptr,  # [rows, HEAD_DIM] in the query's dtype
    num_splits,
    num_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per output row (a token's query head): each split's partial is rescaled by
    ``exp(its max - the overall max)`` (log-sum-exp) and the sum normalised. A row whose splits
    are all empty (sum 0) is written as zeros, as the unsplit kernel writes it."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    maxima = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        part = tl.load(max_ptr + s.to(tl.int64) * num_rows + row, mask=s < num_splits, other=float("-inf"))
        maxima = tl.maximum(maxima, part)
    top = tl.max(maxima, axis=0)
    sums = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        valid = s < num_splits
        offs = s.to(tl.int64) * num_rows + row
        weight = tl.exp(tl.load(max_ptr + offs, mask=valid, other=float("-inf")) - top)
        sums += weight * tl.load(sum_ptr + offs, mask=valid, other=0.0)
        values = tl.load(
            acc_ptr + offs[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None] & d_valid[None, :], other=0.0
        )
        acc += tl.sum(weight[:, None] * values, axis=0)
    total = tl.sum(sums, axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_valid)


def merge_splits(
    acc: torch.Tensor, maxima: torch.Tensor, sums: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Combine the per-split partials ``acc [S, T, Hq, D]``, ``maxima/sums [S, T, Hq]`` (float32,
    contiguous) into ``[T, Hq, D]`` in ``dtype``, with one launch of :func:`merge_splits_kernel`."""
    splits, tokens, heads, dim = acc.shape
    out = torch.empty((tokens, heads, dim), dtype=dtype, device=acc.device)
    block_s = min(16, 1 << max(0, (splits - 1).bit_length()))
    launch(
        merge_splits_kernel,
        (tokens * heads,),
        acc.device,
        acc,
        maxima,
        sums,
        out,
        splits,
        tokens * heads,
        HEAD_DIM=dim,
        BLOCK_S=block_s,
        BLOCK_D=max(16, 1 << max(0, (dim - 1).bit_length())),
    )
    return out


def kernel_for(interpret: bool):
    """The paged-attention kernel, jitted for a GPU or wrapped in Triton's CPU interpreter."""
    return jitted(paged_attention_kernel, interpret)
