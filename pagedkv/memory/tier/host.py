"""Moving KV blocks between the device pool and a host-memory tier, bit for bit.

:mod:`pagedkv.memory.tier.manager` decides which block goes to which tier slot; this module copies
the bytes. A :class:`HostKVTier` is ``capacity`` slots in host memory, one block each, slot
major -- ``[capacity, num_layers, 2, block_size, num_kv_heads, head_dim * element bytes]`` of
raw bytes, plus ``[capacity, num_layers, 2, block_size, num_kv_heads]`` float32 scales for a
quantized cache -- so that a slot is one contiguous run of bytes (what a disk file holds) and a
block keeps its scales beside it. Pinned when the pool is on CUDA, so copies run by DMA.

Everything moves as raw bits (integer views of the cache): a block comes back with exactly the
bits it left with, whatever its element type (fp8 has no CPU index kernels anyway). A block is
one run of bytes per layer and key/value in the pool (``[layers, 2, blocks, ...]``) and one
run in a slot, so each block moves as one strided copy of ``2 * layers`` runs, with no host
temporary, into or out of (on CUDA) pinned memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pagedkv.attention.kv_cache import KVCache
from pagedkv.memory.kv_bytes import DTYPE_BYTES


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
    _copy_out(kv_cache, blocks, _words(tier.data, 3), _words(tier.scales, 3), slots)


def load_blocks(tier: HostKVTier, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy tier slots into pool blocks, ``(slot, block_id)`` each (see :func:`scatter_blocks`)."""
    if not pairs:
        return
    blocks, slots = _check_pairs(kv_cache, tier, [b for _, b in pairs], [s for s, _ in pairs])
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"a destination block appears twice in {pairs}")
    _copy_in(kv_cache, blocks, _words(tier.data, 3), _words(tier.scales, 3), slots)


def gather_blocks(kv_cache: KVCache, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pool blocks as host tensors, slot major: ``[n, *layout.data_shape]`` bytes and, quantized,
    ``[n, *layout.scale_shape]`` scales (pinned on CUDA, and complete when this returns)."""
    layout = KVLayout.of(kv_cache, "")
    pin = kv_cache.device.type == "cuda"
    data = torch.empty((len(blocks), *layout.data_shape), dtype=torch.uint8, pin_memory=pin)
    scales = None
    if kv_cache.scales is not None:
        scales = torch.empty((len(blocks), *layout.scale_shape), dtype=torch.float32, pin_memory=pin)
    _copy_out(kv_cache, blocks, _words(data, 3), _words(scales, 3), range(len(blocks)))
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
    if kv_cache.device.type == "cuda":
        data = data if data.is_pinned() else data.pin_memory()
        scales = scales if scales is None or scales.is_pinned() else scales.pin_memory()
    _copy_in(kv_cache, blocks, _words(data, 3), _words(scales, 3), range(len(blocks)))


def _copy_out(kv_cache: KVCache, blocks, data: torch.Tensor, scales: torch.Tensor | None, rows) -> None:
    """Pool block ``blocks[i]`` -> row ``rows[i]`` of ``data`` (and ``scales``), then wait.

    One strided copy per block: ``[layers, 2]`` runs of one block's contiguous bytes each. Index
    kernels that gather many blocks at once treat every word as an element to index, and are
    far slower on the CPU than these copies of whole runs.
    """
    device = kv_cache.device
    cuda = device.type == "cuda"
    pool = _words(kv_cache.data, 3)  # [layers, 2, blocks, words]
    pool_scales = _words(kv_cache.scales, 3)
    for block, row in zip(blocks, rows, strict=True):
        data[row].copy_(pool[:, :, block], non_blocking=cuda)
        if scales is not None:
            scales[row].copy_(pool_scales[:, :, block], non_blocking=cuda)
    if cuda:
        torch.cuda.current_stream(device).synchronize()


def _copy_in(kv_cache: KVCache, blocks, data: torch.Tensor, scales: torch.Tensor | None, rows) -> None:
    """Row ``rows[i]`` of ``data`` (and ``scales``) -> pool block ``blocks[i]``, queued on CUDA."""
    cuda = kv_cache.device.type == "cuda"
    pool = _words(kv_cache.data, 3)
    pool_scales = _words(kv_cache.scales, 3)
    for block, row in zip(blocks, rows, strict=True):
        pool[:, :, block].copy_(data[row], non_blocking=cuda)
        if scales is not None:
            pool_scales[:, :, block].copy_(scales[row], non_blocking=cuda)


def _words(tensor: torch.Tensor | None, dims: int) -> torch.Tensor | None:
    """A contiguous tensor's first ``dims`` dimensions over the rest as one run of the widest
    integer type that divides it: copies then move bits, never values (so NaN patterns,
    fp8 and int8 pass unchanged), and move them 8 bytes at a time where they can."""
    if tensor is None:
        return None
    run = tensor[(0,) * dims].numel() * tensor.element_size()
    word = next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8) if run % t.itemsize == 0)
    return tensor.reshape(*tensor.shape[:dims], -1).view(torch.uint8).view(word)


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
