"""Input validation shared by every attention backend.

A paged kernel given a block id past the pool or a context longer than its block table would
silently read another sequence's keys (or crash a GPU). So bad input must raise a
:class:`ValueError` naming the offending values instead of producing a wrong answer; backends
may then assume their inputs are consistent.

Where it happens: the engine's model runner checks the step plan it turns into tensors (block
tables cover every slice with blocks of the pool), which makes these tensors valid by
construction; a caller that builds :class:`AttentionMetadata` itself checks it once per step
with :func:`check_step` (every layer reads the same tables). The per-call checks in
:mod:`pagedkv.attention.ops` -- every call of every layer, with reductions that are host syncs
on CUDA -- run only when ``$PAGEDKV_CHECK_EVERY_CALL`` is set (or after
:func:`set_per_call_checks`); the attention tests turn them on.
"""

from __future__ import annotations

import os

import torch

from pagedkv.attention.kv_cache import LayerKV
from pagedkv.attention.metadata import AttentionMetadata

_INT_DTYPES = (torch.int32, torch.int64)

#: Set to 1 to validate the inputs of every attention call (a debugging aid; slow on CUDA).
CHECK_ENV_VAR = "PAGEDKV_CHECK_EVERY_CALL"
_per_call = os.environ.get(CHECK_ENV_VAR, "0") not in ("", "0")


def per_call_checks() -> bool:
    """Whether every attention call validates its inputs (see the module docstring)."""
    return _per_call


def set_per_call_checks(enabled: bool) -> bool:
    """Turn the per-call checks on or off; returns the previous setting."""
    global _per_call
    previous, _per_call = _per_call, bool(enabled)
    return previous


def check_layer_matches(name: str, x: torch.Tensor, layer: LayerKV, heads_multiple: bool) -> None:
    """``x`` is ``[T, heads, head_dim]`` with the cache's dtype (any float dtype for a quantized
    cache: it quantizes what it stores and computes in the query's dtype), device and head layout."""
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if layer.quantized and not x.is_floating_point():
        raise ValueError(f"{name} dtype {x.dtype} is not a float dtype")
    if not layer.quantized and x.dtype != layer.key.dtype:
        raise ValueError(f"{name} dtype {x.dtype} does not match the KV cache dtype {layer.key.dtype}")
    if x.device.type != layer.key.device.type:
        raise ValueError(f"{name} is on {x.device} but the KV cache is on {layer.key.device}")
    if x.shape[2] != layer.head_dim:
        raise ValueError(f"{name} head_dim {x.shape[2]} does not match the cache head_dim {layer.head_dim}")
    heads, kv_heads = x.shape[1], layer.num_kv_heads
    if heads_multiple and (heads % kv_heads != 0):
        raise ValueError(
            f"{name} has {heads} heads, which is not a multiple of the cache's {kv_heads} KV heads"
        )
    if not heads_multiple and heads != kv_heads:
        raise ValueError(f"{name} has {heads} heads but the KV cache has {kv_heads} KV heads")


def check_tables(layer: LayerKV, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Block tables cover every context, and every block a context uses lies in the pool."""
    if block_tables.dim() != 2 or block_tables.dtype not in _INT_DTYPES:
        raise ValueError(
            f"block_tables must be a 2-D int32/int64 tensor, got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    if context_lens.dim() != 1 or context_lens.dtype not in _INT_DTYPES:
        raise ValueError(
            f"context_lens must be a 1-D int32/int64 tensor, got {context_lens.dtype} "
            f"{tuple(context_lens.shape)}"
        )
    num_seqs, max_blocks = block_tables.shape
    if context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"context_lens has {context_lens.shape[0]} entries but block_tables has {num_seqs} rows"
        )
    for t, name in ((block_tables, "block_tables"), (context_lens, "context_lens")):
        if t.device.type != layer.key.device.type:
            raise ValueError(f"{name} is on {t.device} but the KV cache is on {layer.key.device}")
    if num_seqs == 0:
        return
    # Fast path first (two reductions), the offending entry is only searched for on failure.
    shortest, longest = (int(v) for v in torch.aminmax(context_lens))
    capacity = max_blocks * layer.block_size
    if shortest < 1:
        b = int(torch.argmin(context_lens))
        raise ValueError(f"context_lens[{b}] = {shortest}: every sequence needs at least one token")
    if longest > capacity:
        b = int(torch.argmax(context_lens))
        raise ValueError(
            f"context_lens[{b}] = {longest} exceeds the block table's capacity of {capacity} tokens "
            f"({max_blocks} blocks of {layer.block_size})"
        )
    low, high = (int(v) for v in torch.aminmax(block_tables))
    if low >= 0 and high < layer.num_blocks:
        return
    # Some entry lies outside the pool: an error only if a sequence actually uses it.
    used_blocks = (context_lens.long() + layer.block_size - 1) // layer.block_size
    used = torch.arange(max_blocks, device=block_tables.device)[None, :] < used_blocks[:, None]
    outside = used & ((block_tables < 0) | (block_tables >= layer.num_blocks))
    bad = torch.nonzero(outside)
    if bad.numel():
        b, j = (int(v) for v in bad[0])
        raise ValueError(
            f"block_tables[{b}, {j}] = {int(block_tables[b, j])} points outside the pool of "
            f"{layer.num_blocks} blocks"
        )


def check_cu_seqlens(
    cu_seqlens_q: torch.Tensor, num_tokens: int, context_lens: torch.Tensor, max_query_len: int | None = None
) -> None:
    """``cu_seqlens_q`` runs from 0 to at most ``num_tokens`` (rows past its end are padding),
    never decreases, no sequence queries more tokens than its context holds, and the longest
    query run is ``max_query_len`` (when given)."""
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype not in _INT_DTYPES:
        raise ValueError(
            f"cu_seqlens_q must be a 1-D int32/int64 tensor, got {cu_seqlens_q.dtype} "
            f"{tuple(cu_seqlens_q.shape)}"
        )
    if cu_seqlens_q.shape[0] != context_lens.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries; expected num_seqs + 1 = "
            f"{context_lens.shape[0] + 1}"
        )
    cu = cu_seqlens_q.long()
    if int(cu[0]) != 0 or int(cu[-1]) > num_tokens:
        raise ValueError(
            f"cu_seqlens_q must start at 0 and end at most at the number of query tokens {num_tokens}, "
            f"got {int(cu[0])} .. {int(cu[-1])}"
        )
    q_lens = cu[1:] - cu[:-1]
    bad = torch.nonzero(q_lens < 0).flatten()
    if bad.numel():
        raise ValueError(f"cu_seqlens_q must be non-decreasing, it falls at index {int(bad[0]) + 1}")
    bad = torch.nonzero(q_lens > context_lens.long().to(q_lens.device)).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"sequence {b} has {int(q_lens[b])} query tokens but a context of only {int(context_lens[b])}"
        )
    if max_query_len is not None and q_lens.numel() and int(q_lens.max()) != max_query_len:
        raise ValueError(f"max_query_len is {max_query_len} but the longest query run is {int(q_lens.max())}")


def check_slots(layer: LayerKV, slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """One int slot per token, each inside the pool or negative (padding: not written)."""
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must be [{num_tokens}] (one slot per token), got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in _INT_DTYPES:
        raise ValueError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    if num_tokens and int(slot_mapping.max()) >= layer.num_slots:
        raise ValueError(
            f"slot {int(slot_mapping.max())} is past the pool's {layer.num_slots} slots "
            f"({layer.num_blocks} blocks of {layer.block_size})"
        )


def check_step(layer: LayerKV, metadata: AttentionMetadata, num_tokens: int) -> None:
    """Everything the step's tensors must satisfy, checked once per step for all layers (they
    share the block size, the pool size and the tables)."""
    check_slots(layer, metadata.slot_mapping, num_tokens)
    check_tables(layer, metadata.block_tables, metadata.context_lens)
    check_cu_seqlens(metadata.cu_seqlens_q, num_tokens, metadata.context_lens, metadata.max_query_len)
