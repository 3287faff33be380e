"""Whether an engine pages its KV cache by group (hybrid paging, :mod:`pagedkv.memory.kv_groups`):
on for a model with sliding-window layers unless ``disable_hybrid_kv_cache_manager`` says no or
a part of the engine cannot carry a table per group yet -- then off, with the reason logged and
shown by ``describe()``. Both executors ask here: a tensor-parallel rank pages its share of the
KV heads by the same groups, as every rank applies the same table edits."""

from __future__ import annotations

import dataclasses
import logging

from pagedkv.engine.config import EngineSettings
from pagedkv.engine.worker.cuda_graphs import eager_reason
from pagedkv.memory.kv_bytes import KVSpec
from pagedkv.memory.kv_groups import KVGroups, plan_kv_groups
from pagedkv.models import ModelConfig

logger = logging.getLogger("pagedkv.engine.worker.executor.hybrid")


def hybrid_kv_groups(
    config: EngineSettings, model_config: ModelConfig, has_tier: bool, graphs: bool
) -> tuple[KVGroups | None, str]:
    """The KV groups the engine pages by (None: one table per sequence) and why, in words.

    Off with a second KV tier (it moves one block of every layer per id), with decode CUDA
    graphs (they capture one table per sequence) and with unified LoRA paging (an adapter's page
    holds all its layers)."""
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


def engine_kv_groups(config: EngineSettings, model_config: ModelConfig) -> tuple[KVGroups | None, str]:
    """:func:`hybrid_kv_groups` of an engine of ``config``, known before it starts: a second tier
    when ``kv_offload`` is on, decode graphs unless :func:`eager_reason` gives a reason. What
    sizes a pool for engines it does not run (replicas) pages it as they will."""
    options = config.model
    graphs = eager_reason(options.device, options.enforce_eager, config.parallel.tensor_parallel_size) is None
    return hybrid_kv_groups(config, model_config, config.tier.kind is not None, graphs)


def pool_spec(spec: KVSpec, groups: KVGroups | None) -> KVSpec:
    """The spec of one block of the pool: with KV groups a block spans one group's layers."""
    return spec if groups is None else dataclasses.replace(spec, num_layers=groups.group_size)
