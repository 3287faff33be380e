"""Turns one step's plan into tensors, runs the model, and returns the logits to sample.

This is the only place where block tables become tensors: the packed token ids and positions,
the slot each new key/value is written to, the padded block tables and the context lengths that
the attention kernels follow. It reads nothing but the plan and the block tables the plans'
edits built (:class:`~pagedkv.engine.worker.step_inputs.RunnerTables`), so a worker process that
received every plan builds exactly the same step. The plan becomes host arrays, checked on the
way (:mod:`pagedkv.engine.worker.step_inputs`), then device tensors with one copy into buffers kept
from step to step (:mod:`pagedkv.engine.worker.step_buffers`); the host-side facts that size the
kernels' launches travel beside them in the metadata, so no step waits on the device to learn a
shape.

A decode step replays a CUDA graph when the runner has them (:mod:`pagedkv.engine.worker.cuda_graphs`);
every other step runs the model eagerly, as does every step with LoRA adapter rows: the plan's
adapters are written into their pages of the KV cache (unified paging,
:mod:`pagedkv.engine.worker.lora_pages`) after the block moves and copies, their slots pointed
at those pages (or, without unified paging, read from their folders), and each row's slot goes
to the model as its :class:`~pagedkv.models.ops.LoRARows`.
"""

from __future__ import annotations

import torch

from pagedkv.attention import KVCache, copy_blocks
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.cuda_graphs import DecodeGraphs, DecodeGraphSpec
from pagedkv.engine.worker.host_memory import reuse_freed_memory
from pagedkv.engine.worker.lora_pages import PagedAdapterWeights
from pagedkv.engine.worker.runner_tables import RunnerTables
from pagedkv.engine.worker.step_buffers import StepBuffers, StepInputs
from pagedkv.engine.worker.step_inputs import StepArrays, step_arrays
from pagedkv.models.lora_checkpoint import read_adapter
from pagedkv.models.ops import LoRARows


class ModelRunner:
    """Owns the model and its KV cache tensors; :meth:`execute` performs one step's forward pass.

    With ``decode_graphs`` the cache's last block is the padding rows' scratch block: plans may
    use every other block (the pool)."""

    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, decode_graphs: DecodeGraphSpec | None = None
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        #: This rank's second KV tier (``executor/tier_io.RankTier``), moving the plan's
        #: blocks around the copy-on-write copies; None: no tier.
        self.tier = None
        #: Adapters' weights in pages of the KV cache (unified LoRA paging); None: off.
        self.adapter_pages: PagedAdapterWeights | None = None
        if self.device.type == "cpu":
            reuse_freed_memory()
        self.buffers = StepBuffers(self.device)
        self.tables = RunnerTables()
        self.num_pool_blocks = kv_cache.num_blocks - (decode_graphs is not None)
        if self.num_pool_blocks < 1:
            raise ValueError("a KV cache with decode graphs needs a block beside its scratch block")
        self.graphs = None if decode_graphs is None else DecodeGraphs(model, kv_cache, decode_graphs)

    def arrays(self, plan: StepPlan) -> StepArrays:
        """The plan's inputs on the host (its table edits applied), checked against the pool."""
        kv = self.kv_cache
        return step_arrays(plan, self.tables, kv.block_size, self.num_pool_blocks, kv.num_groups)

    def prepare(self, plan: StepPlan) -> StepInputs:
        """The plan's table edits, then its inputs on the device, for an eager forward pass."""
        self.tables.apply(plan)
        return self.buffers.stage(self.arrays(plan))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """The plan's table edits, the tier's moves and the copy-on-write copies, then the
        forward pass; float32 logits of the sampled rows (none for a plan that only moves
        blocks)."""
        self.tables.apply(plan)
        if self.tier is not None:
            self.tier.move(self.kv_cache, plan)
        elif plan.block_copies:
            copy_blocks(self.kv_cache, plan.block_copies)
        self._load_adapters(plan)
        if not plan.slices:
            return torch.empty(0, dtype=torch.float32)
        arrays = self.arrays(plan)
        adapters = any(piece.lora_slot >= 0 for piece in plan.slices)
        if self.graphs is not None and not adapters:
            hidden = self.graphs.run(arrays)
            if hidden is not None:
                return self.model.compute_logits(hidden)
        inputs = self.buffers.stage(arrays)
        rows = None if arrays.samples_every_row else inputs.logits_indices  # all, in order: a decode
        lora = self._lora_rows(plan, rows) if adapters else None
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata, rows, lora)
        return self.model.compute_logits(hidden)

    def _load_adapters(self, plan: StepPlan) -> None:
        """The plan's LoRA adapters into their pages (the folder read now, and checked, unless
        the tier's loads brought them back), then their slots: pointed at their pages, or read
        from the folder without unified paging."""
        for page_write in plan.lora_page_writes:
            if self.adapter_pages is None:
                raise RuntimeError("a plan writes LoRA adapter pages, but this runner does not page adapters")
            self.adapter_pages.write(page_write, self.tier)
        slots = self.model.lora
        for load in plan.lora_loads:
            if load.pages and self.adapter_pages is not None:
                self.adapter_pages.place(load)
            else:
                slots.load(load.slot, read_adapter(load.path, slots.config, slots.max_rank))

    def _lora_rows(self, plan: StepPlan, output_rows: torch.Tensor | None) -> LoRARows | None:
        row_slots = [piece.lora_slot for piece in plan.slices for _ in piece.token_ids]
        return self.model.lora.rows(row_slots, output_rows)
