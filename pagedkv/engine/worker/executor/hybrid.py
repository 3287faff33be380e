"""Whether an engine pages its KV cache by group (hybrid paging, :mod:`pagedkv.memory.kv_groups`):
on for a model with sliding-window layers unless ``disable_hybrid_kv_cache_manager`` says no or
a part of the engine cannot carry a table per group yet -- then off, with the reason logged and
shown by ``describe()``."""

from __future__ import annotations

import logging

from pagedkv.engine.config import EngineSettings
from pagedkv.memory.kv_groups import KVGroups, plan_kv_groups
from pagedkv.models import ModelConfig

logger = logging.getLogger("pagedkv.engine.worker.executor.hybrid")


def hybrid_kv_groups(
    config: EngineSettings, model_config: ModelConfig, has_tier: bool, graphs: bool
) -> tuple[KVGroups | None, str]:
    """The KV groups the engine pages by (None: one table per sequence) and why, in words.

    Off with a second KV tier (it moves one block of every layer per id), with decode CUDA
    graphs (they capture one table per sequence), with unified LoRA paging (an adapter's page
    holds all its layers) and under tensor parallelism (not in this executor)."""
    windows = [model_config.layer_sliding_window(layer) for layer in range(model_config.num_layers)]
    groups = plan_kv_groups(windows)
    if groups is None:
        return None, "off (no sliding-window layer)"
    reason = None
    if config.cache.disable_hybrid_kv_cache_manager:
        reason = "disable_hybrid_kv_cache_manager"
    elif config.lora is not None and config.lora.unified_paging:
        reason = "unified LoRA paging writes an adapter into every layer of its pages"
    elif has_tier:
        reason = "a second KV tier moves whole blocks of every layer"
    elif graphs:
        reason = "CUDA graphs capture one block table per sequence"
    if reason is not None:
        logger.info("hybrid KV paging off for %s: %s", model_config.architecture, reason)
        return None, f"off ({reason})"
    logger.info("hybrid KV paging: %s", groups.describe())
    return groups, groups.describe()
