"""How a model's config splits over tensor-parallel ranks, as :mod:`pagedkv.models.parallel`
cuts the model: each rank its heads, its KV heads (a replicated copy when there are fewer KV
heads than ranks), its intermediate rows, its vocabulary rows. Every rank's share is the same
size (:func:`check_divisible` refuses any other split), so one rank's config says every rank's
shapes.

No torch: the control plane sizes per-rank things (a LoRA adapter's pages in a rank's KV slab)
from it without a rank's tensors.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.models.config import ModelConfig


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming the numbers when ``cfg`` cannot be split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads >= size and cfg.num_kv_heads % size:
        problems.append(f"{cfg.num_kv_heads} key/value heads")
    if cfg.num_kv_heads < size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} key/value heads (fewer than the ranks, and not a divisor)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    moe = cfg.moe
    if moe is not None and moe.expert_size % size:
        problems.append(f"expert intermediate size {moe.expert_size}")
    if moe is not None and (moe.shared_expert_size or 0) % size:
        problems.append(f"shared expert intermediate size {moe.shared_expert_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} cannot split this {cfg.architecture}: "
            f"{', '.join(problems)} not divisible by {size}"
        )


def kv_heads_per_rank(cfg: ModelConfig, size: int) -> int:
    """KV heads each rank holds: ``num_kv_heads / size``, at least one (replicated)."""
    return max(1, cfg.num_kv_heads // size)


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's model: its heads, its intermediate rows (each expert's too), its
    vocabulary rows."""
    check_divisible(cfg, size)
    moe = cfg.moe
    if moe is not None:
        shared = None if moe.shared_expert_size is None else moe.shared_expert_size // size
        moe = dataclasses.replace(moe, expert_size=moe.expert_size // size, shared_expert_size=shared)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=kv_heads_per_rank(cfg, size),
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=-(-cfg.vocab_size // size),
        moe=moe,
    )
