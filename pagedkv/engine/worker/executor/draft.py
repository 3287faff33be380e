"""The draft model of speculative decoding: its own weights and KV cache, in the engine's process.

A draft model proposes tokens that the target model then verifies; it must speak the target's
vocabulary, and it runs wherever the engine runs (rank 0's process under tensor parallelism: a
draft is small enough not to shard). Its KV cache is its own pool of ``num_blocks`` blocks of
the engine's block size, in the draft's dtype, addressed by block tables the draft proposer
keeps (:class:`~pagedkv.engine.spec.draft.DraftModelProposer`): nothing of it is shared with the
target's pool, so a rolled-back or forgotten draft never touches the target's paging.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedkv.attention import KVCache, check_backend_reads
from pagedkv.engine.config import EngineSettings
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.executor.base import runtime_of
from pagedkv.engine.worker.model_runner import ModelRunner
from pagedkv.models import ModelConfig, load_model, shipped_model_path
from pagedkv.models.builtin import SHIPPED_MODELS


def draft_model_path(model: str) -> Path:
    """The folder ``speculative_config.model`` names: a folder, or a shipped model's name."""
    if Path(model).is_dir():
        return Path(model)
    if model in SHIPPED_MODELS:
        return shipped_model_path(model)
    raise ValueError(
        f"speculative_config.model {model!r} is neither a model folder nor a shipped model "
        f"({', '.join(sorted(SHIPPED_MODELS))})"
    )


class DraftExecutor:
    """Loads the draft model and its KV cache; :meth:`execute` runs one step of draft slices."""

    def __init__(self, model: str, config: EngineSettings, num_blocks: int, vocab_size: int) -> None:
        path = draft_model_path(model)
        model_config = ModelConfig.from_pretrained(path)
        if model_config.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config.model {model!r} has a vocabulary of {model_config.vocab_size} "
                f"tokens, the target model {vocab_size}: a draft model must share the target's tokenizer"
            )
        options = config.model
        check_backend_reads(options.attention_backend, options.device, "auto")
        loaded = load_model(
            path,
            options.dtype,
            options.device,
            options.attention_backend,
            options.linear_kernel,
            batch_hint=config.scheduler.max_num_batched_tokens,
            quantized_activations=options.quantized_activations,
        )
        kv_cache = KVCache(
            model_config.kv_spec(), num_blocks, config.cache.block_size, loaded.config.dtype, options.device
        )
        self.model_config = model_config
        self.num_kv_blocks = num_blocks
        self.kv_bytes = kv_cache.nbytes
        self.runtime = runtime_of(loaded)
        self.runner = ModelRunner(loaded, kv_cache)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits of each slice's last row, in plan order."""
        return self.runner.execute(plan)
