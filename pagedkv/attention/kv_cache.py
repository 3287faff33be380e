"""The KV cache tensors: one pool of fixed-size blocks per layer.

PagedAttention only changes *where* keys and values live. Every layer gets a key pool and a
value pool of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; a block id means the
same thing in every layer, so one block table serves the whole model. All layers live in one
allocation so that copy-on-write (:func:`pagedkv.attention.copy_blocks`) is one indexed copy.

With KV groups (hybrid paging, :mod:`pagedkv.memory.kv_groups`) the allocation holds
``group_size`` layers, not one per model layer: layer ``l`` stores into tensor
``layer_slot[l]``, and its :class:`LayerKV` says its ``group``, whose block table it reads.

A quantized cache (``kv_cache_dtype`` ``fp8`` or ``int8``, see :mod:`pagedkv.attention.quant`)
stores one byte per element and keeps a second allocation beside the blocks: one float32 scale
per slot and KV head, ``[num_layers, 2, num_blocks, block_size, num_kv_heads]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedkv.attention.quant import SCALE_DTYPE, check_kv_cache_dtype
from pagedkv.memory.kv_bytes import QUANTIZED_KV_DTYPES, KVSpec
from pagedkv.memory.kv_groups import KVGroups

#: KVSpec dtype names that map onto a torch dtype the attention kernels compute in.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class LayerKV:
    """One layer's key and value pools, ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    for a quantized cache also their scales, ``[num_blocks, block_size, num_kv_heads]`` float32
    (element ``stored * scale`` is the value), else None. ``group``: the KV group whose block
    table addresses it (0 without groups)."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    group: int = 0
    #: the pools' four dimensions, read off ``key`` once
    num_blocks: int = dataclasses.field(init=False, repr=False, compare=False)
    block_size: int = dataclasses.field(init=False, repr=False, compare=False)
    num_kv_heads: int = dataclasses.field(init=False, repr=False, compare=False)
    head_dim: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dims = ("num_blocks", "block_size", "num_kv_heads", "head_dim")
        for name, size in zip(dims, self.key.shape, strict=True):
            object.__setattr__(self, name, int(size))  # frozen: the one place they are set

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def resolve_dtype(spec: KVSpec, dtype: torch.dtype | None) -> torch.dtype:
    """The tensor dtype: the explicit one, else the spec's (which must be a float type)."""
    if dtype is not None:
        if dtype not in TORCH_DTYPES.values():
            raise ValueError(f"KV cache dtype must be one of {list(TORCH_DTYPES.values())}, got {dtype}")
        return dtype
    if spec.dtype not in TORCH_DTYPES:
        raise ValueError(
            f"KVSpec dtype {spec.dtype!r} has no attention kernel; use one of {list(TORCH_DTYPES)}"
        )
    return TORCH_DTYPES[spec.dtype]


def storage_spec(spec: KVSpec, dtype: torch.dtype | None, kv_cache_dtype: str = "auto") -> KVSpec:
    """The spec of what is stored: the model's KV shape in the cache's element type (the
    quantized types' spec counts their scales, see :attr:`KVSpec.bytes_per_token`)."""
    if check_kv_cache_dtype(kv_cache_dtype) is not None:
        return dataclasses.replace(spec, dtype=QUANTIZED_KV_DTYPES[kv_cache_dtype])
    resolved = resolve_dtype(spec, dtype)
    return dataclasses.replace(spec, dtype=next(n for n, t in TORCH_DTYPES.items() if t == resolved))


class KVCache:
    """Per-layer key/value block pools for a model described by a :class:`KVSpec`.

    The pools start zeroed, so even a kernel bug that read an unwritten slot would read finite
    numbers; the kernels themselves never read a slot past a sequence's context length.
    ``dtype`` (the model's dtype, what attention computes in and returns) decides the tensors'
    element type unless ``kv_cache_dtype`` names a quantized one (``fp8``, ``int8``); when
    ``dtype`` is ``None`` the spec's dtype name is used. :attr:`spec` describes what is stored.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str = "auto",
        groups: KVGroups | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.dtype = resolve_dtype(spec, dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.spec = storage_spec(spec, self.dtype, kv_cache_dtype)
        self.storage_dtype = check_kv_cache_dtype(kv_cache_dtype) or self.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.groups = groups
        if groups is not None and groups.num_layers != spec.num_layers:
            raise ValueError(f"KV groups of {groups.num_layers} layers for a model of {spec.num_layers}")
        tensors = spec.num_layers if groups is None else groups.group_size
        shape = (tensors, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        #: [tensors, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]; tensors is
        #: num_layers, or a group's layer count with KV groups
        self.data = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)
        #: [tensors, 2, num_blocks, block_size, num_kv_heads] float32, or None when not quantized
        self.scales: torch.Tensor | None = None
        if self.storage_dtype != self.dtype:
            self.scales = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=self.device)
        slots = range(spec.num_layers) if groups is None else groups.layer_slot
        self.layers: list[LayerKV] = []
        for layer, slot in enumerate(slots):
            kv, sc = self.data[slot], None if self.scales is None else self.scales[slot]
            group = 0 if groups is None else groups.layer_group[layer]
            scales = (None, None) if sc is None else (sc[0], sc[1])
            self.layers.append(LayerKV(kv[0], kv[1], *scales, group=group))

    @staticmethod
    def block_bytes(
        spec: KVSpec, block_size: int, dtype: torch.dtype | None = None, kv_cache_dtype: str = "auto"
    ) -> int:
        """Bytes one block takes across all layers, keys and values (and their scales)."""
        return storage_spec(spec, dtype, kv_cache_dtype).bytes_per_block(block_size)

    @classmethod
    def from_memory(
        cls,
        spec: KVSpec,
        memory_bytes: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> KVCache:
        """As many whole blocks as fit in ``memory_bytes``; an error when not even one fits."""
        num_blocks = cls.blocks_in(memory_bytes, spec, block_size, dtype, kv_cache_dtype)
        return cls(spec, num_blocks, block_size, dtype, device, kv_cache_dtype)

    @classmethod
    def blocks_in(
        cls,
        memory_bytes: int,
        spec: KVSpec,
        block_size: int,
        dtype: torch.dtype | None = None,
        kv_cache_dtype: str = "auto",
    ) -> int:
        """How many whole blocks fit in ``memory_bytes``; an error when not even one fits."""
        per_block = cls.block_bytes(spec, block_size, dtype, kv_cache_dtype)
        num_blocks = int(memory_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"a KV memory budget of {memory_bytes} bytes holds no block of {block_size} tokens "
                f"({per_block} bytes each)"
            )
        return num_blocks

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_groups(self) -> int:
        """Block tables a step carries per sequence: one per KV group (1 without groups)."""
        return 1 if self.groups is None else self.groups.num_groups

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks and their scales."""
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + scales

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={self.num_layers}, blocks={self.num_blocks}, block_size={self.block_size}, "
            f"kv_heads={self.spec.num_kv_heads}, head_dim={self.spec.head_dim}, dtype={self.dtype}, "
            f"storage={self.storage_dtype}, "
            f"device={self.device}, bytes={self.nbytes})"
        )
