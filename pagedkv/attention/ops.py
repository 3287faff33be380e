"""The KV-cache operations a model calls: write, copy-on-write, and paged attention.

These wrappers validate their inputs (see :mod:`pagedkv.attention.checks`) and then dispatch to
a backend (see :mod:`pagedkv.attention.backends`). A model's attention layer makes exactly one
call per step, :func:`paged_attention`.
"""

from __future__ import annotations

import torch

from pagedkv.attention.backends import get_backend
from pagedkv.attention.checks import check_cu_seqlens, check_layer_matches, check_options, check_tables
from pagedkv.attention.kv_cache import KVCache, LayerKV
from pagedkv.attention.metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Scatter ``key/value [T, kv_heads, head_dim]`` into their slots (``block_id * block_size +
    offset``); tokens whose slot is negative are padding and are not written."""
    check_layer_matches("key", key, layer, heads_multiple=False)
    check_layer_matches("value", value, layer, heads_multiple=False)
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be [{key.shape[0]}] (one slot per token), got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    if key.shape[0] == 0:
        return
    slots = slot_mapping.to(device=layer.key.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
    top = int(slots.max())
    if top >= layer.num_slots:
        raise ValueError(
            f"slot {top} is past the pool's {layer.num_slots} slots "
            f"({layer.num_blocks} blocks of {layer.block_size})"
        )
    flat = (layer.num_slots, layer.num_kv_heads, layer.head_dim)
    layer.key.view(flat).index_copy_(0, slots, key)
    layer.value.view(flat).index_copy_(0, slots, value)


def copy_blocks(kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` in every layer at once (copy-on-write). All sources are
    read before any destination is written; a destination may appear only once."""
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
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=device)
    kv_cache.data[:, :, dst_t] = kv_cache.data[:, :, src_t]


def paged_decode_attention(
    q: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """One query token per sequence (``q [B, Hq, D]``, the last of its ``context_lens[b]``
    tokens) attending over its paged context. Returns ``[B, Hq, D]`` in ``q``'s dtype."""
    check_layer_matches("q", q, layer, heads_multiple=True)
    check_options(scale, sliding_window, soft_cap)
    check_tables(layer, block_tables, context_lens)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"decode has {q.shape[0]} query tokens but {block_tables.shape[0]} sequences")
    if q.shape[0] == 0:
        return torch.empty_like(q)
    impl = get_backend(backend, q.device)
    return impl.decode(q, layer, block_tables, context_lens, float(scale), sliding_window, soft_cap)


def paged_prefill_attention(
    q: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention for a packed batch of new tokens: sequence ``b``'s query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` are the last positions of its ``context_lens[b]``
    tokens, so they see the cached prefix and the new tokens up to themselves. Rows past
    ``cu_seqlens_q[-1]`` are padding: their output is zero."""
    check_layer_matches("q", q, layer, heads_multiple=True)
    check_options(scale, sliding_window, soft_cap)
    check_tables(layer, block_tables, context_lens)
    check_cu_seqlens(cu_seqlens_q, q.shape[0], context_lens)
    num_real = int(cu_seqlens_q[-1]) if cu_seqlens_q.numel() else 0
    if num_real == 0:
        return torch.zeros_like(q)
    impl = get_backend(backend, q.device)
    out = impl.prefill(
        q[:num_real], layer, block_tables, cu_seqlens_q, context_lens, float(scale), sliding_window, soft_cap
    )
    if num_real < q.shape[0]:
        out = torch.cat([out, out.new_zeros((q.shape[0] - num_real, *q.shape[1:]))])
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: LayerKV,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The one call a model's attention layer makes per step: store this step's keys/values in
    their slots, then attend (decode when every sequence has one new token, else prefill)."""
    write_kv(k, v, layer, metadata.slot_mapping)
    if metadata.is_decode_only and q.shape[0] == metadata.num_seqs:
        return paged_decode_attention(
            q, layer, metadata.block_tables, metadata.context_lens, scale, sliding_window, soft_cap, backend
        )
    return paged_prefill_attention(
        q,
        layer,
        metadata.block_tables,
        metadata.cu_seqlens_q,
        metadata.context_lens,
        scale,
        sliding_window,
        soft_cap,
        backend,
    )
