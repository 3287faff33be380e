"""The per-step tables the C decode stack's records read, by index: the rotary tables and each
KV group's slots and block tables.

A record is lowered once per KV cache (:mod:`pagedkv.models.decode_stack`); what changes every
step -- the positions' ``cos``/``sin``, the slots the new keys and values go to, the block
tables -- travels as small arrays of addresses the C indexes by a record's ``rope`` (0: the
model's rotary table, 1: the sliding layers' own, Gemma 3's) and ``group`` (its layer's KV
group under hybrid paging; 0 without groups). :class:`StepTables` holds those arrays and points
them at a step's tensors.
"""

from __future__ import annotations

import torch

from pagedkv.attention import AttentionMetadata
from pagedkv.attention.backends import cpu_rows
from pagedkv.kernels.signatures import ADDRESS, I64
from pagedkv.models.ops import ForwardBatch


class StepTables:
    """The address arrays for ``num_groups`` KV groups in ``dtype``; ``local_rope``: whether a
    record reads the second rotary table (the step must then have one)."""

    def __init__(self, dtype: torch.dtype, num_groups: int, local_rope: bool) -> None:
        self.dtype, self.local_rope = dtype, local_rope
        self.cos, self.sin = (ADDRESS * 2)(), (ADDRESS * 2)()
        self.slots, self.tables = (ADDRESS * num_groups)(), (ADDRESS * num_groups)()
        #: each group's block tables' width (``max_blocks``)
        self.widths = (I64 * num_groups)()

    def point(self, batch: ForwardBatch, rows: cpu_rows.KernelRows) -> bool:
        """Point the arrays at the step of ``batch`` (``rows``: its kernel rows, group 0's);
        False when a table the records read is missing or not what the C reads."""
        return self._rotary(batch) and self._groups(rows, batch.metadata)

    def _rotary(self, batch: ForwardBatch) -> bool:
        local = (batch.local_cos, batch.local_sin) if self.local_rope else (batch.cos, batch.sin)
        for i, (cos, sin) in enumerate(((batch.cos, batch.sin), local)):
            if cos is None or sin is None or not cos.dtype == sin.dtype == self.dtype:
                return False
            if not (cos.is_contiguous() and sin.is_contiguous()):
                return False
            self.cos[i], self.sin[i] = cos.data_ptr(), sin.data_ptr()
        return True

    def _groups(self, rows: cpu_rows.KernelRows, metadata: AttentionMetadata) -> bool:
        """Each group's slots and tables: its metadata's (without groups in the metadata every
        group reads the step's own), the slots int64 as the C reads them."""
        for group in range(len(self.slots)):
            of_group = metadata.of_group(group)
            group_rows = rows if of_group is metadata else cpu_rows.generated_rows(of_group)
            slots = of_group.slot_mapping
            if group_rows is None or slots.dtype != torch.int64 or not slots.is_contiguous():
                return False
            self.slots[group], self.tables[group] = slots.data_ptr(), group_rows.tables.data_ptr()
            self.widths[group] = group_rows.tables.shape[1]
        return True
