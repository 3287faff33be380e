"""Moving KV blocks between the device pool and a host-memory tier, bit for bit.

:mod:`pagedkv.memory.tiered` decides which block goes to which tier slot; this module copies
the bytes. A :class:`HostKVTier` is ``capacity`` slots in host memory, one block each, slot
major -- ``[capacity, num_layers, 2, block_size, num_kv_heads, head_dim * element bytes]`` of
raw bytes, plus ``[capacity, num_layers, 2, block_size, num_kv_heads]`` float32 scales for a
quantized cache -- so that a slot is one contiguous run of bytes (what a disk file holds) and a
block keeps its scales beside it. Pinned when the pool is on CUDA, so copies run by DMA.

Everything moves as raw bytes (``uint8`` views of the cache): a block comes back with exactly
the bits it left with, whatever its element type (fp8 has no CPU index kernels anyway), and the
copies go layer by layer, so the temporary on the device is one layer's blocks, not a model's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pagedkv.attention.kv_cache import KVCache
from pagedkv.memory.spec import DTYPE_BYTES


@dataclass(frozen=True)
class KVLayout:
    """What a tier block's bytes mean: a block written under one layout is only ever read back
    under the same one (the disk tier's files carry it in their header). ``model`` names the
    weights (a fingerprint): keys and values of other weights are other numbers."""

    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def of(cls, kv_cache: KVCache, model: str, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
        """The layout of one rank's cache (its share of the KV heads)."""
        spec = kv_cache.spec
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        return cls(
            model,
            dtype,
            kv_cache.kv_cache_dtype,
            kv_cache.block_size,
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            tp_rank,
            tp_size,
        )

    @property
    def element_bytes(self) -> int:
        return 1 if self.quantized else DTYPE_BYTES[self.dtype]

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def data_shape(self) -> tuple[int, ...]:
        """One block's bytes: ``[num_layers, 2, block_size, num_kv_heads, head_dim * bytes]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim * self.element_bytes)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """One block's scales (float32): ``[num_layers, 2, block_size, num_kv_heads]``."""
        return self.data_shape[:-1]

    @property
    def data_bytes(self) -> int:
        return _numel(self.data_shape)

    @property
    def scale_bytes(self) -> int:
        return 4 * _numel(self.scale_shape) if self.quantized else 0

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in a tier: its elements and, quantized, its scales."""
        return self.data_bytes + self.scale_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


class HostKVTier:
    """``capacity`` block slots in host memory for caches of ``layout`` (see the module doc)."""

    def __init__(self, layout: KVLayout, capacity: int, pin_memory: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"a host KV tier needs at least one slot, got capacity {capacity}")
        self.layout = layout
        self.capacity = capacity
        self.data = torch.zeros((capacity, *layout.data_shape), dtype=torch.uint8, pin_memory=pin_memory)
        self.scales: torch.Tensor | None = None
        if layout.quantized:
            shape = (capacity, *layout.scale_shape)
            self.scales = torch.ones(shape, dtype=torch.float32, pin_memory=pin_memory)

    @classmethod
    def for_cache(cls, kv_cache: KVCache, capacity: int, model: str = "") -> HostKVTier:
        """A tier for ``kv_cache``'s blocks, pinned when the cache is on CUDA."""
        return cls(KVLayout.of(kv_cache, model), capacity, pin_memory=kv_cache.device.type == "cuda")

    @property
    def nbytes(self) -> int:
        return self.capacity * self.layout.block_bytes

    def check_fits(self, kv_cache: KVCache) -> None:
        """Refuse a cache whose blocks have another shape or element type than the slots."""
        theirs = KVLayout.of(kv_cache, self.layout.model, self.layout.tp_rank, self.layout.tp_size)
        if theirs != self.layout:
            raise ValueError(f"the KV cache's layout {theirs} is not the tier's {self.layout}")


def store_blocks(kv_cache: KVCache, tier: HostKVTier, pairs: list[tuple[int, int]]) -> None:
    """Copy pool blocks into tier slots, ``(block_id, slot)`` each. Returns once the tier holds
    the bytes, so the pool blocks may be reused at once."""
    if not pairs:
        return
    blocks, slots = _check_pairs(kv_cache, tier, [b for b, _ in pairs], [s for _, s in pairs])
    data, scales = gather_blocks(kv_cache, blocks)
    where = torch.tensor(slots, dtype=torch.long)
    tier.data.index_copy_(0, where, data)
    if scales is not None and tier.scales is not None:
        tier.scales.index_copy_(0, where, scales)


def load_blocks(tier: HostKVTier, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy tier slots into pool blocks, ``(slot, block_id)`` each (see :func:`scatter_blocks`)."""
    if not pairs:
        return
    blocks, slots = _check_pairs(kv_cache, tier, [b for _, b in pairs], [s for s, _ in pairs])
    where = torch.tensor(slots, dtype=torch.long)
    scales = None if tier.scales is None else tier.scales.index_select(0, where)
    scatter_blocks(kv_cache, blocks, tier.data.index_select(0, where), scales)


def gather_blocks(kv_cache: KVCache, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pool blocks as host tensors, slot major: ``[n, *layout.data_shape]`` bytes and, quantized,
    ``[n, *layout.scale_shape]`` scales (pinned on CUDA, and complete when this returns)."""
    device = kv_cache.device
    cuda = device.type == "cuda"
    ids = torch.tensor(blocks, dtype=torch.long, device=device)
    source = kv_cache.data.view(torch.uint8)
    shape = (len(blocks), *source.shape[:2], *source.shape[3:])  # [n, layers, 2, bs, heads, bytes]
    data = torch.empty(shape, dtype=torch.uint8, pin_memory=cuda)
    for layer in range(kv_cache.num_layers):
        data[:, layer].copy_(source[layer].index_select(1, ids).transpose(0, 1), non_blocking=cuda)
    scales = None
    if kv_cache.scales is not None:
        scales = torch.empty((len(blocks), *data.shape[1:-1]), pin_memory=cuda)
        scales.copy_(kv_cache.scales.index_select(2, ids).permute(2, 0, 1, 3, 4), non_blocking=cuda)
    if cuda:
        torch.cuda.current_stream(device).synchronize()
    return data, scales


def scatter_blocks(
    kv_cache: KVCache, blocks: list[int], data: torch.Tensor, scales: torch.Tensor | None
) -> None:
    """Write host tensors shaped as :func:`gather_blocks` returns into pool ``blocks``. On CUDA the
    copies are queued on the current stream, ahead of the forward pass that reads them."""
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"a destination block appears twice in {blocks}")
    if (scales is None) != (kv_cache.scales is None):
        raise ValueError("a quantized cache's blocks move only with their scales")
    device = kv_cache.device
    ids = torch.tensor(blocks, dtype=torch.long, device=device)
    if device.type == "cuda":
        data = data.pin_memory().to(device, non_blocking=True)
        scales = None if scales is None else scales.pin_memory().to(device, non_blocking=True)
    target = kv_cache.data.view(torch.uint8)
    for layer in range(kv_cache.num_layers):
        target[layer].index_copy_(1, ids, data[:, layer].transpose(0, 1))
    if scales is not None:
        kv_cache.scales.index_copy_(2, ids, scales.permute(1, 2, 0, 3, 4))


def _check_pairs(
    kv_cache: KVCache, tier: HostKVTier, blocks: list[int], slots: list[int]
) -> tuple[list[int], list[int]]:
    if (kv_cache.scales is None) != (tier.scales is None):
        raise ValueError("a quantized cache's blocks move only with their scales: tier and cache differ")
    for block in blocks:
        if not 0 <= block < kv_cache.num_blocks:
            raise ValueError(f"block {block} is outside the pool of {kv_cache.num_blocks}")
    for slot in slots:
        if not 0 <= slot < tier.capacity:
            raise ValueError(f"slot {slot} is outside the tier of {tier.capacity}")
    return [int(b) for b in blocks], [int(s) for s in slots]
