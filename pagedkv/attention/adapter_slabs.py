"""LoRA adapter weights written into, read back from, and pointed at in their pages of the KV
cache.

The worker's half of unified paging (:mod:`pagedkv.memory.adapter_pages` is the control plane's):
an adapter's pages are block ids, and in layer ``l`` block ``b`` is two contiguous chunks of
``KVCache.data`` -- ``data[l, 0, b]`` (keys) and ``data[l, 1, b]`` (values). Layer ``l``'s rows,
laid out by :class:`~pagedkv.memory.adapter_layout.AdapterLayout`, fill the chunks ``key(b0),
value(b0), key(b1), value(b1), ...`` in that order; every other element of those chunks is zeroed.
The forward pass reads the rows where they are, through their element offsets in the cache
(:func:`row_offsets`); reading a layer back whole (:func:`gather_adapter_layer`) is one gather
of its chunks, bit-exact to what was written.

The weights are stored in the cache's element type, which is the model's: a quantized cache
(``kv_cache_dtype`` ``fp8``/``int8``) is refused, its one-byte elements cannot hold them.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import torch

from pagedkv.attention.kv_cache import KVCache
from pagedkv.memory.adapter_layout import AdapterLayout, TargetSlot, chunk_elements

#: Per layer, each target module's ``(A, B)``: ``A`` ``[rank, in_features]``, ``B`` ``[out_features, rank]``.
LayerWeights = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def check_unified_paging(kv_cache: KVCache) -> None:
    """Refuse a KV cache whose blocks cannot hold adapter weights, naming why."""
    if kv_cache.scales is not None or kv_cache.storage_dtype != kv_cache.dtype:
        raise ValueError(
            "LoRA adapters cannot be paged in a quantized KV cache "
            f"(kv_cache_dtype={kv_cache.kv_cache_dtype!r} stores {kv_cache.storage_dtype}); "
            "use kv_cache_dtype='auto' to page adapters with the KV cache"
        )
    if kv_cache.data.dim() != 6 or not kv_cache.data.is_contiguous():
        raise ValueError(
            "LoRA adapters are paged in one contiguous KV tensor [layers, 2, blocks, block_size, kv_heads, "
            f"head_dim]; this cache's is {tuple(kv_cache.data.shape)}"
        )


def cache_chunk_elements(kv_cache: KVCache) -> int:
    """Elements of one block's keys (or values) in one layer of ``kv_cache``."""
    spec = kv_cache.spec
    return chunk_elements(kv_cache.block_size, spec.num_kv_heads, spec.head_dim)


def chunk_index(kv_cache: KVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """The rows of :func:`_layer_chunks` that make up ``block_ids``' chunks, in page order (each
    page's keys, then its values)."""
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= kv_cache.num_blocks):
        raise ValueError(
            f"adapter pages {list(block_ids)} are not all blocks of a {kv_cache.num_blocks}-block cache"
        )
    return torch.stack([blocks, blocks + kv_cache.num_blocks], dim=1).reshape(-1).to(kv_cache.device)


def _layer_chunks(kv_cache: KVCache, layer: int) -> torch.Tensor:
    """Layer ``layer``'s cache as ``[2 * num_blocks, block_size * kv_heads * head_dim]``: keys'
    chunks, then values' (a view)."""
    data = kv_cache.data[layer]
    return data.view(2 * kv_cache.num_blocks, -1)


def _check_pages(kv_cache: KVCache, block_ids: Sequence[int], layout: AdapterLayout) -> None:
    check_unified_paging(kv_cache)
    if layout.num_layers != kv_cache.num_layers:
        raise ValueError(f"the adapter has {layout.num_layers} layers, the KV cache {kv_cache.num_layers}")
    if layout.chunk != cache_chunk_elements(kv_cache):
        raise ValueError(f"the layout's chunks of {layout.chunk} elements are not this KV cache's")
    if len(block_ids) != layout.pages:
        raise ValueError(f"the adapter needs {layout.pages} page(s) of this KV cache, got {len(block_ids)}")


def _elements(slot: TargetSlot, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of every element of ``slot``'s ``A`` rows ``[rank, in]`` and ``B`` rows
    ``[rank, out]``."""
    a = torch.tensor(slot.a_rows, dtype=torch.long, device=device).unsqueeze(1)
    b = torch.tensor(slot.b_rows, dtype=torch.long, device=device).unsqueeze(1)
    return a + torch.arange(slot.a_shape[1], device=device), b + torch.arange(slot.b_shape[0], device=device)


def write_adapter(
    kv_cache: KVCache, block_ids: Sequence[int], per_layer_weights: Sequence[LayerWeights]
) -> AdapterLayout:
    """Lay each layer's ``A`` and ``B`` (transposed) per target into that layer's chunks of
    ``block_ids``, in the cache's dtype; returns the layout that finds them. Only those blocks
    change."""
    shapes = [
        {t: (tuple(a.shape), tuple(b.shape)) for t, (a, b) in layer.items()} for layer in per_layer_weights
    ]
    layout = AdapterLayout.of(shapes, cache_chunk_elements(kv_cache))
    _check_pages(kv_cache, block_ids, layout)
    index = chunk_index(kv_cache, block_ids)
    for layer, (slots, weights) in enumerate(zip(layout.layers, per_layer_weights, strict=True)):
        flat = torch.zeros(index.numel() * layout.chunk, dtype=kv_cache.dtype, device=kv_cache.device)
        for slot in slots:
            a, b = weights[slot.target]
            a_at, b_at = _elements(slot, flat.device)
            flat[a_at] = a.to(flat)
            flat[b_at] = b.t().to(flat)
        chunks = _layer_chunks(kv_cache, layer)
        chunks.index_copy_(0, index, flat.view(index.numel(), -1))
    return layout


def pages_checksum(kv_cache: KVCache, block_ids: Sequence[int]) -> int:
    """The CRC-32 of ``block_ids``' bytes in every layer, in page order: what a second tier
    copies of them, so a copy brought back is checked against the pages it was made of."""
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    pages = kv_cache.data.index_select(2, index).contiguous().view(torch.uint8)
    return zlib.crc32(pages.cpu().numpy().reshape(-1))


def gather_adapter_layer(
    kv_cache: KVCache, block_ids: Sequence[int] | torch.Tensor, layout: AdapterLayout, layer: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer ``layer``'s ``{target: (A, B)}`` (``B`` as ``[out, rank]``, a transposed view): one
    gather of the adapter's chunks, then each matrix's rows picked out of it. ``block_ids`` may be a
    :func:`chunk_index` computed once per load (what a runner keeps)."""
    if isinstance(block_ids, torch.Tensor):
        index = block_ids
    else:
        _check_pages(kv_cache, block_ids, layout)
        index = chunk_index(kv_cache, block_ids)
    flat = _layer_chunks(kv_cache, layer).index_select(0, index).view(-1)
    read = {}
    for slot in layout.layers[layer]:
        a_at, b_at = _elements(slot, flat.device)
        read[slot.target] = (flat[a_at], flat[b_at].t())
    return read


def adapter_views(
    kv_cache: KVCache, block_ids: Sequence[int], layout: AdapterLayout
) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Every layer's ``{target: (A, B)}`` read back from the adapter's pages."""
    _check_pages(kv_cache, block_ids, layout)
    index = chunk_index(kv_cache, block_ids)
    return [gather_adapter_layer(kv_cache, index, layout, layer) for layer in range(layout.num_layers)]


def row_offsets(
    kv_cache: KVCache, block_ids: Sequence[int], layout: AdapterLayout
) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Every layer's ``{target: (A rows, B rows)}`` as element offsets into ``kv_cache.data``
    (int64 on the host, ``[rank]`` each): where the forward pass reads each rank row of ``A``
    and of ``B`` transposed. Needs :attr:`AdapterLayout.rows_fit` (a row within one chunk is
    contiguous in the cache)."""
    _check_pages(kv_cache, block_ids, layout)
    if not layout.rows_fit:
        raise ValueError(f"the adapter has rows wider than a KV chunk of {layout.chunk} elements")
    pages = torch.as_tensor(list(block_ids), dtype=torch.long)
    blocks = kv_cache.num_blocks

    def offsets(rows: tuple[int, ...], layer: int) -> torch.Tensor:
        """Position p is data[layer, chunk % 2, pages[chunk // 2]] at p % chunk (chunk = p // chunk)."""
        position = torch.tensor(rows, dtype=torch.long)
        chunk, within = position // layout.chunk, position % layout.chunk
        return ((layer * 2 + chunk % 2) * blocks + pages[chunk // 2]) * layout.chunk + within

    return [
        {slot.target: (offsets(slot.a_rows, layer), offsets(slot.b_rows, layer)) for slot in slots}
        for layer, slots in enumerate(layout.layers)
    ]
