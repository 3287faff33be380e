"""The KV-cache operations a model calls: write, copy-on-write, and paged attention.

A model's attention layer stores the step's keys and values and then attends, with the
:class:`~pagedkv.attention.backends.Backend` it resolved when it was built: one call,
:func:`paged_attention`, or :func:`attend` after a write fused with the rotary embedding
(:mod:`pagedkv.models.layer_ops`, what the Llama family does on the CPU). The step's inputs
are valid by the model runner's check of the step plan (or once per step through
:func:`pagedkv.attention.checks.check_step` for hand-built metadata); these
wrappers check again on every call only when the per-call checks are on (see
:mod:`pagedkv.attention.checks`). :func:`paged_decode_attention` and
:func:`paged_prefill_attention` are the same kernels for callers that hold plain tensors (tests,
benchmarks).
"""

from __future__ import annotations

import torch

from pagedkv.attention import checks
from pagedkv.attention.backends import Backend, resolve_backend
from pagedkv.attention.kv_cache import KVCache, LayerKV
from pagedkv.attention.metadata import AttentionMetadata, AttentionOptions
from pagedkv.attention.quant import quantize


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    layer: LayerKV,
    slot_mapping: torch.Tensor,
    padded: bool | None = None,
) -> None:
    """Scatter ``key/value [T, kv_heads, head_dim]`` into their slots (``block_id * block_size +
    offset``); tokens whose slot is negative are padding and are not written. A quantized layer
    stores each token's heads quantized, with their scales beside them. ``padded`` says whether
    any slot is negative (:attr:`AttentionMetadata.has_padding`, found once per step); None
    looks, which costs a host sync."""
    if checks.per_call_checks():
        checks.check_layer_matches("key", key, layer, heads_multiple=False)
        checks.check_layer_matches("value", value, layer, heads_multiple=False)
        if key.shape != value.shape:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
        checks.check_slots(layer, slot_mapping, key.shape[0])
    if key.shape[0] == 0:
        return
    slots = slot_mapping.to(device=layer.key.device, dtype=torch.long)
    if padded is None or padded:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
    flat = (layer.num_slots, layer.num_kv_heads, layer.head_dim)
    key_pool, value_pool = layer.key.view(flat), layer.value.view(flat)
    if layer.quantized:
        key, key_scale = quantize(key, layer.key.dtype)
        value, value_scale = quantize(value, layer.value.dtype)
        layer.key_scale.view(flat[:2]).index_copy_(0, slots, key_scale)
        layer.value_scale.view(flat[:2]).index_copy_(0, slots, value_scale)
        # as raw bytes: torch's CPU index_copy_ has no float8 kernel
        key_pool, value_pool, key, value = (t.view(torch.uint8) for t in (key_pool, value_pool, key, value))
    key_pool.index_copy_(0, slots, key)
    value_pool.index_copy_(0, slots, value)


def copy_blocks(kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` in every layer at once (copy-on-write), with their scales
    when the cache is quantized. All sources are read before any destination is written; a
    destination may appear only once. Nothing here waits for the device."""
    if not pairs:
        return
    src = [int(s) for s, _ in pairs]
    dst = [int(d) for _, d in pairs]
    for block in src + dst:
        if not 0 <= block < kv_cache.num_blocks:
            raise ValueError(f"copy_blocks: block {block} is outside the pool of {kv_cache.num_blocks}")
    if len(set(dst)) != len(dst):
        raise ValueError(f"copy_blocks: a destination block appears twice in {pairs}")
    device = kv_cache.data.device
    # one non-blocking copy of both index lists from pinned memory: no wait for the device
    pinned = device.type == "cuda"
    index = torch.tensor(src + dst, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=pinned)
    src_t, dst_t = index[: len(src)], index[len(src) :]
    data = kv_cache.data if kv_cache.scales is None else kv_cache.data.view(torch.uint8)  # see write_kv
    data[:, :, dst_t] = data[:, :, src_t]
    if kv_cache.scales is not None:
        kv_cache.scales[:, :, dst_t] = kv_cache.scales[:, :, src_t]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: LayerKV,
    metadata: AttentionMetadata,
    options: AttentionOptions,
    backend: Backend | str | None = None,
) -> torch.Tensor:
    """Store this step's keys/values in their slots, then attend (decode when every sequence has
    one new token, else prefill)."""
    write_kv(k, v, layer, metadata.slot_mapping, metadata.has_padding)
    return attend(q, layer, metadata, options, backend)


def attend(
    q: torch.Tensor,
    layer: LayerKV,
    metadata: AttentionMetadata,
    options: AttentionOptions,
    backend: Backend | str | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` for a caller that has already stored the step's keys and values
    in their slots (a fused rotary + write, see :mod:`pagedkv.models.layer_ops`)."""
    backend = resolve_backend(backend, q.device)
    if metadata.is_decode_only and q.shape[0] == metadata.num_seqs:
        return _decode(q, layer, metadata, options, backend)
    return _prefill(q, layer, metadata, options, backend)


def paged_decode_attention(
    q: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: Backend | str | None = None,
) -> torch.Tensor:
    """One query token per sequence (``q [B, Hq, D]``, the last of its ``context_lens[b]``
    tokens) attending over its paged context. Returns ``[B, Hq, D]`` in ``q``'s dtype."""
    options = AttentionOptions(scale, sliding_window, soft_cap)
    metadata = AttentionMetadata.for_attention_only(block_tables, context_lens)
    return _decode(q, layer, metadata, options, resolve_backend(backend, q.device))


def paged_prefill_attention(
    q: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: Backend | str | None = None,
) -> torch.Tensor:
    """Causal attention for a packed batch of new tokens: sequence ``b``'s query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` are the last positions of its ``context_lens[b]``
    tokens, so they see the cached prefix and the new tokens up to themselves. Rows past
    ``cu_seqlens_q[-1]`` are padding: their output is zero."""
    options = AttentionOptions(scale, sliding_window, soft_cap)
    metadata = AttentionMetadata.for_attention_only(block_tables, context_lens, cu_seqlens_q)
    return _prefill(q, layer, metadata, options, resolve_backend(backend, q.device))


def _decode(
    q: torch.Tensor, layer: LayerKV, metadata: AttentionMetadata, options: AttentionOptions, backend: Backend
) -> torch.Tensor:
    if checks.per_call_checks():
        checks.check_layer_matches("q", q, layer, heads_multiple=True)
        checks.check_tables(layer, metadata.block_tables, metadata.context_lens)
        if q.shape[0] != metadata.num_seqs:
            raise ValueError(f"decode has {q.shape[0]} query tokens but {metadata.num_seqs} sequences")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    return backend.decode(q, layer, metadata, options)


def _prefill(
    q: torch.Tensor, layer: LayerKV, metadata: AttentionMetadata, options: AttentionOptions, backend: Backend
) -> torch.Tensor:
    cu_seqlens_q = metadata.cu_seqlens_q
    if checks.per_call_checks():
        checks.check_layer_matches("q", q, layer, heads_multiple=True)
        checks.check_tables(layer, metadata.block_tables, metadata.context_lens)
        checks.check_cu_seqlens(cu_seqlens_q, q.shape[0], metadata.context_lens, metadata.max_query_len)
    num_real = metadata.query_rows()
    if num_real == 0:
        return torch.zeros_like(q)
    out = backend.prefill(q[:num_real], layer, metadata, options)
    if num_real < q.shape[0]:
        out = torch.cat([out, out.new_zeros((q.shape[0] - num_real, *q.shape[1:]))])
    return out
