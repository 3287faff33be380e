"""Builders for paged test cases and the contiguous attention they must agree with.

A case scatters random keys/values for ragged sequences into a block pool whose physical
blocks are shuffled (a block table is never a range) and whose every other slot holds NaN: a
kernel that reads a slot ``write_kv`` never wrote poisons its output and fails the comparison.
In a quantized pool (int8 has no NaN) the unwritten slots' scales hold NaN instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.attention import KVCache, LayerKV, write_kv
from pagedkv.memory.kv_bytes import KVSpec

#: where the paged side of every case lives; ``benchmarks/gpu_check.sh`` sets it to ``cuda``
DEVICE = torch.device(os.environ.get("PAGEDKV_TEST_DEVICE", "cpu"))
#: the backends that accept tensors on DEVICE
BACKENDS = ["torch", "cpu", "triton"] if DEVICE.type == "cpu" else ["torch", "triton"]


@dataclass
class PagedCase:
    cache: KVCache
    layer: LayerKV
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence, [context_len, kv_heads, head_dim] (un-paged)
    values: list[torch.Tensor]


def slots_for(table_row: list[int], positions: range, block_size: int) -> list[int]:
    return [table_row[p // block_size] * block_size + p % block_size for p in positions]


def make_case(
    context_lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    spare_columns: int = 1,
    num_layers: int = 1,
    device: torch.device | str = DEVICE,
    kv_cache_dtype: str = "auto",
) -> PagedCase:
    """Sequences of the given lengths, written through :func:`write_kv` into shuffled blocks
    (stored quantized when ``kv_cache_dtype`` says so; ``keys``/``values`` stay unquantized)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    spec = KVSpec(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype="float32")
    cache = KVCache(spec, num_blocks, block_size, dtype, device, kv_cache_dtype)
    if cache.scales is None:
        cache.data.fill_(float("nan"))
    else:
        cache.scales.fill_(float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(needed) + spare_columns
    # Padding columns hold valid but unrelated block ids: they must never be read.
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen, dtype=torch.int32)
    keys, values, slots = [], [], []
    start = 0
    for b, (n, k) in enumerate(zip(context_lens, needed, strict=True)):
        tables[b, :k] = torch.tensor(perm[start : start + k], dtype=torch.int32)
        start += k
        keys.append(torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype))
        slots += slots_for(tables[b].tolist(), range(n), block_size)
    layer = cache.layers[0]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    write_kv(torch.cat(keys).to(device), torch.cat(values).to(device), layer, slot_mapping)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return PagedCase(cache, layer, tables.to(device), lens, keys, values)


def contiguous_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of the *last* ``len(q)`` positions over un-paged ``key/value [L, Hkv, D]``,
    via ``scaled_dot_product_attention`` in float32 on the CPU (explicit math only for the
    soft-cap)."""
    q, key, value = q.cpu(), key.cpu(), value.cpu()
    num_q, num_heads, _ = q.shape
    length, kv_heads, _ = key.shape
    q_pos = torch.arange(length - num_q, length)
    k_pos = torch.arange(length)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, key, value))  # [H, L, D]
    kf = kf.repeat_interleave(num_heads // kv_heads, dim=0)
    vf = vf.repeat_interleave(num_heads // kv_heads, dim=0)
    if soft_cap is None:
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale)
    else:
        scores = soft_cap * torch.tanh(qf @ kf.transpose(1, 2) * scale / soft_cap)
        out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ vf
    return out.transpose(0, 1)


TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCE[dtype])
