"""Turns one step's plan into tensors, runs the model, and returns the logits to sample.

This is the only place where block tables become tensors: the packed token ids and positions,
the slot each new key/value is written to, the padded block tables and the context lengths that
the attention kernels follow. It reads nothing but the plan, so a worker process that received
the plan builds exactly the same step.

It also checks the plan, once per step for every layer, as it reads it: each slice's block
table covers its positions with blocks inside the pool, and it computes at least one position
(the pool bounds on the tables' array at once; the first bad slice is named when one fails).
The other invariants of :func:`pagedkv.attention.checks.check_step` (slots inside the pool,
non-decreasing query offsets no longer than the contexts, ``max_query_len``) hold by
construction then. check_step runs ~20 small tensor ops a step; these checks are a few NumPy
reductions over arrays the step builds anyway.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from pagedkv.attention import AttentionMetadata, KVCache, copy_blocks
from pagedkv.engine.host_memory import reuse_freed_memory
from pagedkv.engine.plan import StepPlan


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    #: Rows of the packed batch whose logits are returned (``SeqSlice.logits_rows``), increasing:
    #: as many as the batch has rows means all of them.
    logits_indices: torch.Tensor


class ModelRunner:
    """Owns the model and its KV cache tensors; :meth:`execute` performs one step's forward pass."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        if self.device.type == "cpu":
            reuse_freed_memory()

    def prepare(self, plan: StepPlan) -> StepInputs:
        bs, num_blocks = self.kv_cache.block_size, self.kv_cache.num_blocks
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        cu_seqlens = [0]
        logits_indices: list[int] = []
        for piece in plan.slices:
            table, start, end = piece.block_table, piece.start, piece.end
            if start < 0 or end <= start or len(table) * bs < end:
                _refuse(plan, bs, num_blocks)
            input_ids += piece.token_ids
            positions += range(start, end)
            # Slot runs block by block (a decode is one run): no Python step per token.
            for block in range(start // bs, (end - 1) // bs + 1):
                base = table[block] * bs - block * bs
                slots += range(base + max(start, block * bs), base + min(end, (block + 1) * bs))
            context_lens.append(end)
            cu_seqlens.append(cu_seqlens[-1] + end - start)
            rows = piece.logits_rows()
            logits_indices += range(cu_seqlens[-2] + rows.start, cu_seqlens[-2] + rows.stop)
        # The tables, as one array and checked as one (a Python min and max over every table
        # took as long as the rest of this method at 2-token blocks).
        tables = _padded_tables([piece.block_table for piece in plan.slices])
        if tables.min() < 0 or tables.max() >= num_blocks:
            _refuse(plan, bs, num_blocks)
        prompt_lens = [piece.prompt_len for piece in plan.slices]

        def tensor(values: list | np.ndarray, dtype: type[np.signedinteger]) -> torch.Tensor:
            # Through NumPy: one bulk conversion, where torch.tensor(list) converts element by
            # element.
            return torch.from_numpy(np.asarray(values, dtype=dtype)).to(self.device)

        metadata = AttentionMetadata(
            slot_mapping=tensor(slots, np.int64),
            block_tables=tensor(tables, np.int32),
            context_lens=tensor(context_lens, np.int32),
            cu_seqlens_q=tensor(cu_seqlens, np.int32),
            max_query_len=max(len(piece.token_ids) for piece in plan.slices),
            prompt_lens=None if None in prompt_lens else tensor(prompt_lens, np.int32),
        )
        return StepInputs(
            input_ids=tensor(input_ids, np.int64),
            positions=tensor(positions, np.int64),
            metadata=metadata,
            logits_indices=tensor(logits_indices, np.int64),
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Copy-on-write copies, then the forward pass; float32 logits of the sampled rows."""
        if plan.block_copies:
            copy_blocks(self.kv_cache, plan.block_copies)
        inputs = self.prepare(plan)
        rows = inputs.logits_indices
        every_row = rows.shape[0] == inputs.input_ids.shape[0]  # in order: a decode step
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata, None if every_row else rows
        )
        return self.model.compute_logits(hidden)


def _padded_tables(tables: list[list[int]]) -> np.ndarray:
    """The block tables as one int32 array padded with block 0 (never read: a row reads only
    its context's blocks). Through one flat array and one scatter, where NumPy reading a list of
    padded lists walks every Python list again."""
    widths = np.fromiter(map(len, tables), np.int64, len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(widths.sum()))
    padded = np.zeros((len(tables), int(widths.max())), np.int32)
    padded[np.arange(padded.shape[1]) < widths[:, None]] = flat
    return padded


def _refuse(plan: StepPlan, bs: int, num_blocks: int) -> NoReturn:
    """Raise for the first slice whose block table does not cover its positions with blocks
    of the pool (or that computes nothing)."""
    for i, piece in enumerate(plan.slices):
        table, start, end = piece.block_table, piece.start, piece.end
        used = table[: -(-end // bs)]  # the blocks the attention reads and the slots written
        if start < 0 or end <= start or len(used) * bs < end or min(used) < 0 or max(used) >= num_blocks:
            raise ValueError(
                f"step plan slice {i} computes positions {start}..{end - 1}, but its block table "
                f"{table} does not cover them with blocks of the pool's {num_blocks} "
                f"(block size {bs})"
            )
    raise ValueError(f"a step plan's block tables hold ids outside the pool's {num_blocks} blocks")
