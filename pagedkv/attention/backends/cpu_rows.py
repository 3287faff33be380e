"""Which query rows the ``cpu`` backend's row kernel computes in a step, and on how many threads.

A step of the row kernel is its block tables and each query row's sequence and position
(:class:`KernelRows`); every layer of the step passes the same rows, so a step builds them once
(:func:`decode_rows`, :func:`generated_rows`), not once per layer, and keeps them in its
metadata (:meth:`~pagedkv.attention.metadata.AttentionMetadata.derived`), where the C decode
stack reads the same ones. :func:`split_work` sizes the flash-decoding split of long contexts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pagedkv.attention.metadata import AttentionMetadata

#: bounds on the positions one kernel task covers (flash-decoding split of long contexts)
MIN_CHUNK, MAX_CHUNK = 64, 2048
#: multiply-adds per pass below which the kernel runs on one thread. Low enough that one
#: request's decode uses every thread once its context is more than a few blocks long: its
#: blocks come cold from DRAM, and another thread's share of the stream pays for the fork/join.
PARALLEL_MIN_WORK = 1 << 16


@dataclass
class KernelRows:
    """What the kernel reads besides ``q`` and the cache, as int32: the block tables and each
    query row's sequence and position. Every layer of a step passes the same rows, so a decode
    step builds them once (:func:`decode_rows`), not once per layer."""

    tables: Tensor
    row_seq: Tensor
    row_pos: Tensor
    #: attended positions summed over the rows, per sliding window (0: none); sizes the threads
    totals: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, block_tables: Tensor, row_seq: Tensor, row_pos: Tensor) -> KernelRows:
        def as_int32(t: Tensor) -> Tensor:
            return t.to(torch.int32).contiguous()

        return cls(as_int32(block_tables), as_int32(row_seq), as_int32(row_pos))

    def total(self, window: int) -> int:
        if window not in self.totals:
            lengths = self.row_pos.numpy().astype(np.int64) + 1  # NumPy: a few us, not tens
            self.totals[window] = int((np.minimum(lengths, window) if window else lengths).sum())
        return self.totals[window]


def split_work(total: int, num_heads: int, head_dim: int) -> tuple[int, int]:
    """The kernel's threads and positions per task for rows attending ``total`` positions in all.

    Like torch's own grain size: small work stays on one thread, where a fork/join costs more
    than it saves (and a thread descheduled on a busy machine stalls the whole region)."""
    threads = torch.get_num_threads() if total * num_heads * head_dim >= PARALLEL_MIN_WORK else 1
    per_task = math.ceil(total / (4 * threads))
    return threads, min(MAX_CHUNK, max(MIN_CHUNK, per_task))


def decode_rows(metadata: AttentionMetadata) -> KernelRows:
    """The kernel rows of a decode step, built by its first layer and kept for the others."""
    return metadata.derived(decode_rows, _decode_rows)


def _decode_rows(metadata: AttentionMetadata) -> KernelRows:
    row_seq = np.arange(metadata.context_lens.shape[0], dtype=np.int32)
    row_pos = metadata.context_lens.numpy() - 1
    return KernelRows.of(metadata.block_tables, torch.from_numpy(row_seq), torch.from_numpy(row_pos))


def generated_rows(metadata: AttentionMetadata) -> KernelRows | None:
    """The kernel rows of a step whose every query row is a generated token -- decodes, and
    the ``k + 1`` rows of each sequence that verifies ``k`` proposed tokens -- or None for a
    step with a prompt row or without the sequences' prompt lengths. These are the rows
    :func:`prefill` gives the row kernel for such a step: each row attends its sequence's
    positions up to its own, as a decode at that position would. Built with NumPy, once per
    step: torch calls on such small arrays cost several times more."""
    if metadata.is_decode_only and metadata.cu_seqlens_q.shape[0] - 1 == metadata.num_seqs:
        return decode_rows(metadata)
    return metadata.derived(generated_rows, _generated_rows)


def _generated_rows(metadata: AttentionMetadata) -> KernelRows | None:
    if metadata.prompt_lens is None:
        return None
    cu = metadata.cu_seqlens_q.numpy()
    q_lens = cu[1:] - cu[:-1]
    first_pos = metadata.context_lens.numpy() - q_lens
    if not bool((first_pos >= metadata.prompt_lens.numpy()).all()):
        return None
    row_seq = np.repeat(np.arange(q_lens.shape[0], dtype=np.int32), q_lens)
    row_pos = (first_pos[row_seq] + np.arange(row_seq.shape[0]) - cu[row_seq]).astype(np.int32)
    return KernelRows.of(metadata.block_tables, torch.from_numpy(row_seq), torch.from_numpy(row_pos))
