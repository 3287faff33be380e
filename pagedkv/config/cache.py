"""The KV cache's part of the engine's settings: its blocks, their element type, the pool's size
and what the pool shares (vLLM's ``CacheConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.config.checks import optional_positive_int, positive_int
from pagedkv.memory.kv_bytes import KV_CACHE_DTYPE_NAMES


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool's shape. Every field is checked here, so the executors size the pool from
    values already known good.

    The pool's size comes from one of three sources, first set wins: ``num_kv_blocks``, then
    ``pool_bytes`` (an explicit ``kv_cache_memory``), then "auto" (both None: the executor
    measures the memory left once the weights are loaded; ``pagedkv.memory.pool_sizing``).
    """

    #: Tokens per KV block.
    block_size: int
    #: "auto" (the model's dtype), "fp8" or "int8": what each KV element is stored in.
    kv_cache_dtype: str
    #: KV blocks in each rank's pool, as given; None: sized from ``pool_bytes`` or "auto".
    num_kv_blocks: int | None
    #: Bytes of each rank's pool (``kv_cache_memory`` parsed); None: "auto".
    pool_bytes: int | None
    #: Full blocks are indexed by their prefix and reused by later requests.
    enable_prefix_caching: bool
    #: Share of the blocks kept free at admission, so running sequences can still grow.
    watermark: float
    #: Keep every block of a sliding-window layer (vLLM's flag): off, a model with windowed
    #: layers pages them by KV group and hands back blocks out of every window
    #: (:mod:`pagedkv.memory.hybrid_manager`).
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of {list(KV_CACHE_DTYPE_NAMES)}"
            )
        optional_positive_int("num_kv_blocks", self.num_kv_blocks)
        optional_positive_int("kv_cache_memory", self.pool_bytes)
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
