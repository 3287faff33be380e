"""The ``torch`` backend: the readable ground truth.

Per sequence it gathers exactly the context's keys and values out of the block pool (dropping
the unwritten tail of the last block before any arithmetic; dequantizing a quantized pool's
keys and values with their scales), then computes attention the
textbook way in float32: scores, optional soft-cap, causal/sliding-window mask, softmax,
weighted sum. Slow and obviously right; every other backend is tested against it and against
contiguous ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedkv.attention import quant
from pagedkv.attention.kv_cache import LayerKV
from pagedkv.attention.metadata import AttentionMetadata, AttentionOptions

#: the reference reads every cache dtype
KV_CACHE_DTYPES = tuple(quant.KV_CACHE_DTYPES)


def gather_context(
    layer: LayerKV, table_row: torch.Tensor, context_len: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``context_len`` keys and values of one sequence, ``[context_len, kv_heads,
    head_dim]``: in the pool's dtype, or dequantized into ``dtype`` when the pool is quantized."""
    num_blocks = -(-context_len // layer.block_size)
    blocks = table_row[:num_blocks].long()
    shape = (-1, layer.num_kv_heads, layer.head_dim)
    if layer.quantized:  # gathered as raw bytes: torch's CPU index_select has no float8 kernel
        key = layer.key.view(torch.uint8).index_select(0, blocks).view(layer.key.dtype)
        value = layer.value.view(torch.uint8).index_select(0, blocks).view(layer.value.dtype)
    else:
        key, value = layer.key.index_select(0, blocks), layer.value.index_select(0, blocks)
    key, value = key.reshape(shape)[:context_len], value.reshape(shape)[:context_len]
    if layer.quantized:
        scale_shape = (-1, layer.num_kv_heads)
        key_scale = layer.key_scale.index_select(0, blocks).reshape(scale_shape)[:context_len]
        value_scale = layer.value_scale.index_select(0, blocks).reshape(scale_shape)[:context_len]
        key, value = quant.dequantize(key, key_scale, dtype), quant.dequantize(value, value_scale, dtype)
    return key, value


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """``[Lq, Lk]`` bool: causal, and within the last ``sliding_window`` positions (Mistral/HF)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return allowed


def attend(q: Tensor, key: Tensor, value: Tensor, q_pos: Tensor, options: AttentionOptions) -> Tensor:
    """Attention of ``q [Lq, Hq, D]`` over ``key/value [Lk, Hkv, D]`` in float32; ``q_pos`` are
    the queries' absolute positions (keys sit at positions ``0..Lk-1``)."""
    num_q, num_heads, head_dim = q.shape
    kv_heads = key.shape[1]
    qf = q.float().reshape(num_q, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.einsum("qhgd,khd->hgqk", qf, key.float()) * options.scale
    if options.soft_cap is not None:
        scores = options.soft_cap * torch.tanh(scores / options.soft_cap)
    k_pos = torch.arange(key.shape[0], device=q.device)
    scores = scores.masked_fill(~allowed_mask(q_pos, k_pos, options.sliding_window), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, value.float())
    return out.reshape(num_q, num_heads, head_dim).to(q.dtype)


def prefill(q: Tensor, layer: LayerKV, metadata: AttentionMetadata, options: AttentionOptions) -> Tensor:
    out = torch.empty_like(q)
    cu = metadata.cu_seqlens_q.tolist()
    for b, context_len in enumerate(metadata.context_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        key, value = gather_context(layer, metadata.block_tables[b], context_len)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        out[start:end] = attend(q[start:end], key, value, q_pos, options)
    return out


#: A decode step is a prefill step whose query runs are one token long.
decode = prefill
