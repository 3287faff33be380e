"""What one forward step tells the attention layers about the batch it carries.

The model runner builds one of these per step from the scheduler's output; every attention
layer reads it. It is the whole contract between the engine (requests, block tables) and the
attention kernels (tensors): nothing about requests crosses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """The step's tokens are packed: sequence ``b`` owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, which are the *last* ``q_len`` positions of its
    ``context_lens[b]`` tokens (cached prefix + tokens computed this step).

    slot_mapping: [T] int64, physical slot (block_id * block_size + offset) that each new token's
        key/value is written to; a negative slot means "do not write" (padding).
    block_tables: [B, max_blocks] int32, logical -> physical block ids per sequence (padded
        with any valid id; entries past a sequence's length are never read).
    context_lens: [B] int32, tokens each sequence attends over after this step's writes.
    cu_seqlens_q: [B + 1] int32, prefix sums of the query lengths.
    max_query_len: the longest query length in the step (1 means a pure decode step).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])
