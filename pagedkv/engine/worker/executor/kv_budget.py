"""The KV pool's size on each rank, from the engine's options and the memory the device has
left (the rule: :mod:`pagedkv.memory.pool_sizing`).

``num_kv_blocks`` wins, then an explicit ``kv_cache_memory``; ``kv_cache_memory="auto"`` asks
the device what it can still give once the weights are in place. The executors measure that
themselves -- after loading when the model lives in their process, before the ranks start
less the weights they will load when it does not -- and hand it in as a callable, so an
explicit size never probes anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedkv.engine.config import EngineSettings
from pagedkv.memory.hybrid_manager import group_peak_blocks
from pagedkv.memory.kv_groups import KVGroups
from pagedkv.memory.pool_sizing import AUTO, PoolSizing, auto_pool_blocks, available_host_memory


def available_memory(device: str | torch.device) -> int:
    """Bytes a new allocation on ``device`` can get now: a CUDA device's free memory, else the
    host's (:func:`~pagedkv.memory.pool_sizing.available_host_memory`)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return available_host_memory()


def size_pool(
    config: EngineSettings,
    block_bytes: int,
    max_model_len: int,
    available: Callable[[], int],
    ranks_sharing: int = 1,
    kv_groups: KVGroups | None = None,
) -> PoolSizing:
    """One rank's pool: ``block_bytes`` per block on that rank; ``available()`` the bytes left
    after the weights, drawn on by ``ranks_sharing`` ranks (only called for "auto"). With
    ``kv_groups`` "auto" counts one full-context request in every group (:func:`request_blocks`)."""
    ranks, cache = config.parallel.tensor_parallel_size, config.cache
    if cache.num_kv_blocks is not None:
        return PoolSizing(cache.num_kv_blocks, cache.block_size, block_bytes, "num_kv_blocks", ranks=ranks)
    budget = cache.pool_bytes
    if budget is not None:
        blocks = budget // block_bytes
        if blocks < 1:
            raise ValueError(
                f"a KV memory budget of {budget} bytes per rank holds no block of "
                f"{cache.block_size} tokens ({block_bytes} bytes each)"
            )
        return PoolSizing(blocks, cache.block_size, block_bytes, "kv_cache_memory", ranks=ranks)
    free = available()
    blocks = auto_pool_blocks(
        free,
        block_bytes,
        cache.block_size,
        max_model_len,
        config.scheduler.max_num_seqs,
        ranks_sharing,
        request_blocks(config, kv_groups, max_model_len),
    )
    return PoolSizing(blocks, cache.block_size, block_bytes, AUTO, available=free, ranks=ranks)


def request_blocks(config: EngineSettings, kv_groups: KVGroups | None, max_model_len: int) -> int | None:
    """With KV groups, the blocks one request at the full context holds at its peak -- a prompt
    one token short of it, chunked as the scheduler chunks prompts, the hybrid manager's own
    count -- plus the null block; None without groups (the context's blocks)."""
    if kv_groups is None:
        return None
    chunk, last = config.scheduler.max_num_batched_tokens, max(0, max_model_len - 1)
    return group_peak_blocks(kv_groups, config.cache.block_size, chunk, last, max_model_len) + 1
