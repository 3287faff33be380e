"""The executor that runs the model in the engine's own process, on one device."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pagedkv.attention import KVCache, check_backend_reads
from pagedkv.engine.config import EngineSettings
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.cuda_graphs import DecodeGraphSpec, eager_reason
from pagedkv.engine.worker.executor.base import Executor, ExecutorError, KVMemory, runtime_of
from pagedkv.engine.worker.executor.hybrid import hybrid_kv_groups, pool_spec
from pagedkv.engine.worker.executor.kv_budget import available_memory, size_pool
from pagedkv.engine.worker.executor.tier_io import RankTier, plan_tier
from pagedkv.engine.worker.lora_pages import PagedAdapterWeights, reads_pages
from pagedkv.engine.worker.model_runner import ModelRunner
from pagedkv.models import ModelConfig, load_model
from pagedkv.models.lora import LoRASlots
from pagedkv.models.lora_paged import PagedLoRA


class InProcessExecutor(Executor):
    """Loads the model and allocates the KV cache (``num_kv_blocks`` blocks, or as many as
    ``kv_cache_memory`` holds, or with "auto" a share of what the device has left once the
    weights are loaded: :mod:`~pagedkv.engine.worker.executor.kv_budget`) on ``config.model.device``; runs
    each step on the calling thread.

    On CUDA (unless ``enforce_eager``) the runner captures decode graphs at start-up and the
    cache gets one block more than the pool: the padding rows' scratch block
    (:mod:`pagedkv.engine.worker.cuda_graphs`)."""

    def __init__(self, config: EngineSettings, model_path: Path, model_config: ModelConfig) -> None:
        options = config.model
        # Before the weights or any block are allocated: a KV dtype the device's backend cannot
        # read is a configuration error.
        check_backend_reads(options.attention_backend, options.device, config.cache.kv_cache_dtype)
        self.tier = plan_tier(config, model_path, model_config)  # refused before allocating
        model = load_model(
            model_path,
            options.dtype,
            options.device,
            options.attention_backend,
            options.linear_kernel,
            batch_hint=config.scheduler.max_num_batched_tokens,
            load_format=options.load_format,
            quantization=options.quantization,
            quantized_activations=options.quantized_activations,
        )
        dtype = model.config.dtype
        spec = model_config.kv_spec()
        lora = config.lora
        in_pages = (
            lora is not None
            and lora.unified_paging
            and reads_pages(model, spec.num_kv_heads, spec.head_dim, config.cache.block_size)
        )
        if lora is not None and not in_pages:  # before the pool is sized, and the first forward pass
            model.lora = LoRASlots(model, lora.max_loras, lora.max_lora_rank)
        kv_dtype = config.cache.kv_cache_dtype
        max_model_len = options.max_model_len or model_config.max_position_embeddings
        eager = eager_reason(options.device, options.enforce_eager, config.parallel.tensor_parallel_size)
        self.kv_groups, hybrid = hybrid_kv_groups(config, model_config, self.tier is not None, eager is None)
        block_size = config.cache.block_size
        block_bytes = KVCache.block_bytes(pool_spec(spec, self.kv_groups), block_size, dtype, kv_dtype)
        # measured now: the weights are in place, nothing of the pool is yet
        available = functools.partial(available_memory, options.device)  # probed only for "auto"
        self.kv_sizing = size_pool(config, block_bytes, max_model_len, available, 1, self.kv_groups)
        blocks = self.kv_sizing.num_blocks
        graphs = None
        if eager is None:
            graphs = DecodeGraphSpec.for_engine(config.scheduler.max_num_seqs, max_model_len, options.device)
        kv_cache = KVCache(
            spec,
            blocks + (graphs is not None),
            config.cache.block_size,
            dtype,
            options.device,
            kv_dtype,
            self.kv_groups,
        )
        if in_pages:  # the adapters' one copy is in the pages (no slot tensors); before any forward pass
            model.lora = PagedLoRA(model, lora.max_loras, lora.max_lora_rank, kv_cache.data)
        self.num_kv_blocks = blocks
        self.kv_memory = KVMemory(kv_dtype, kv_cache.spec.bytes_per_token, kv_cache.nbytes)
        self.runner: ModelRunner | None = ModelRunner(model, kv_cache, graphs)
        self.runtime = runtime_of(model) | {"cuda graphs": eager or graphs.describe(), "hybrid kv": hybrid}
        if self.tier is not None:
            self.runner.tier = RankTier(self.tier, kv_cache)
        if lora is not None and lora.unified_paging:  # a quantized cache is refused
            pages = PagedAdapterWeights(kv_cache, model.lora)
            self.runner.adapter_pages = pages

    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self.runner is None:
            raise ExecutorError("the executor was shut down")
        return self.runner.execute(plan)

    def check_health(self) -> None:
        if self.runner is None:
            raise ExecutorError("the executor was shut down")

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.tier is not None:
            self.runner.tier.close()  # a disk tier's queued files are written first
        self.runner = None  # the model and the KV cache go with it
