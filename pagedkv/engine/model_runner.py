"""Turns a scheduled step into tensors, runs the model, and returns the logits to sample.

This is the only place where the engine's block tables become tensors: the packed token ids
and positions, the slot each new key/value is written to, the padded block tables and the
context lengths that the attention kernels follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.attention import AttentionMetadata, KVCache, check_step, copy_blocks
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.memory import KVCacheManager


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    #: Row of each sampled sequence's last token in the packed batch.
    logits_indices: torch.Tensor


class ModelRunner:
    """Owns the model and its KV cache tensors; ``run`` performs one step's forward pass."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, kv_manager: KVCacheManager) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.device = kv_cache.device

    def prepare(self, step: SchedulerOutput) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        cu_seqlens = [0]
        logits_indices: list[int] = []
        for item in step.scheduled:
            seq, start, end = item.seq, item.start, item.end
            table = self.kv_manager.table(seq.seq_id)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table.slots(start, end))
            tables.append(table.block_ids)
            context_lens.append(end)
            cu_seqlens.append(cu_seqlens[-1] + item.num_new_tokens)
            if item.needs_logits:
                logits_indices.append(cu_seqlens[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        metadata = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(padded, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            max_query_len=max(item.num_new_tokens for item in step.scheduled),
        )
        # Once per step, for every layer: they all read these tables (see attention/checks.py).
        check_step(self.kv_cache.layers[0], metadata, len(input_ids))
        return StepInputs(
            input_ids=tensor(input_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            metadata=metadata,
            logits_indices=tensor(logits_indices, torch.int64),
        )

    @torch.inference_mode()
    def run(self, step: SchedulerOutput) -> torch.Tensor:
        """Copy-on-write copies, then the forward pass; float32 logits of the sampled rows."""
        if step.block_copies:
            copy_blocks(self.kv_cache, step.block_copies)
        inputs = self.prepare(step)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        return self.model.compute_logits(hidden[inputs.logits_indices])
