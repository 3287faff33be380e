"""The host side of a step's inputs: the step plan as NumPy arrays, and a decode batch padded to
the batch size of a captured CUDA graph.

Every shape a step launches with is decided here, from the plan alone: the token and sequence
counts, the longest query and the longest context, whether a decode step replays a graph and
at which size. Nothing here touches a tensor, so none of it can wait on a device; the model
runner sends the arrays to the device in one copy (:mod:`pagedkv.engine.worker.step_buffers`).

The runner keeps every sequence's block table (:mod:`pagedkv.engine.worker.runner_tables`) and brings
it up to date with each plan's edits before it reads the plan here.

The runner also checks the plan here, once per step for every layer, as it reads it: each
slice's block table covers its positions with blocks inside the pool, and it computes at least
one position (the pool bounds on the tables' array at once; the first bad slice is named when
one fails). The other invariants of :func:`pagedkv.attention.checks.check_step` (slots inside
the pool, non-decreasing query offsets no longer than the contexts, ``max_query_len``) hold by
construction then: a few NumPy reductions over arrays the step builds anyway, where check_step
runs ~20 small tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NoReturn

import numpy as np

from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.runner_tables import GroupTables, RunnerTables


@dataclass(frozen=True)
class StepArrays:
    """One step's inputs in the packed layout of
    :class:`~pagedkv.attention.metadata.AttentionMetadata` (sequence ``b`` owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``), with the host-side facts a launch needs."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [G * T] int64, never negative: each KV group's in turn (G = 1 without)
    #: the rows whose logits the step returns (``SeqSlice.logits_rows``), increasing
    logits_indices: np.ndarray  # [L] int64
    context_lens: np.ndarray  # [S] int32
    cu_seqlens_q: np.ndarray  # [S + 1] int32
    block_tables: np.ndarray  # [S, W] int32, padded with any id of the pool; [G, S, W] with G groups
    prompt_lens: np.ndarray | None  # [S] int32, or None when a slice does not say
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_groups(self) -> int:
        return 1 if self.block_tables.ndim == 2 else int(self.block_tables.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def samples_every_row(self) -> bool:
        """Whether the logits rows are all the rows, in order (a decode step's)."""
        return self.logits_indices.shape[0] == self.num_tokens


def step_arrays(
    plan: StepPlan, tables: RunnerTables | GroupTables, block_size: int, num_blocks: int, num_groups: int = 1
) -> StepArrays:
    """The plan's inputs, its slices' block tables read from ``tables`` (the plan's edits
    applied); ``num_blocks``: the pool's blocks, which every table entry must be among (a
    ValueError naming the first slice that breaks it). With ``num_groups`` KV groups a table
    interleaves the groups' (:class:`~pagedkv.memory.grouped_table.GroupedTable`): the arrays
    then hold each group's slots and tables in turn (:func:`grouped_arrays`)."""
    if num_groups > 1:
        return grouped_arrays(plan, tables, block_size, num_blocks, num_groups)
    bs = block_size
    slice_tables = [tables.get(piece.seq_id) for piece in plan.slices]
    if None in slice_tables:
        _refuse(plan, slice_tables, bs, num_blocks)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    context_lens: list[int] = []
    cu_seqlens = [0]
    logits_indices: list[int] = []
    for piece, table in zip(plan.slices, slice_tables, strict=True):
        start, end = piece.start, piece.end
        if start < 0 or end <= start or len(table) * bs < end:
            _refuse(plan, slice_tables, bs, num_blocks)
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
    # The tables, as one array and checked as one (not a Python min and max per table).
    padded = tables.padded([piece.seq_id for piece in plan.slices], max(map(len, slice_tables)))
    if padded.min() < 0 or padded.max() >= num_blocks:
        _refuse(plan, slice_tables, bs, num_blocks)
    prompt_lens = [piece.prompt_len for piece in plan.slices]
    return StepArrays(
        input_ids=np.asarray(input_ids, np.int64),
        positions=np.asarray(positions, np.int64),
        slot_mapping=np.asarray(slots, np.int64),
        logits_indices=np.asarray(logits_indices, np.int64),
        context_lens=np.asarray(context_lens, np.int32),
        cu_seqlens_q=np.asarray(cu_seqlens, np.int32),
        block_tables=padded,
        prompt_lens=None if None in prompt_lens else np.asarray(prompt_lens, np.int32),
        max_query_len=max(len(piece.token_ids) for piece in plan.slices),
        max_seq_len=max(context_lens),
    )


def grouped_arrays(
    plan: StepPlan, tables: RunnerTables | GroupTables, block_size: int, num_blocks: int, num_groups: int
) -> StepArrays:
    """:func:`step_arrays` of tables interleaving ``num_groups`` KV groups: the slots of group 0,
    then of group 1, ...; the tables ``[num_groups, S, W]``. A sliding group's null entries
    (block 0) are read as zeros behind the window's mask, never written."""
    assert isinstance(tables, RunnerTables)
    per_group = [
        step_arrays(plan, tables.group(g, num_groups), block_size, num_blocks) for g in range(num_groups)
    ]
    return replace(
        per_group[0],
        slot_mapping=np.concatenate([arrays.slot_mapping for arrays in per_group]),
        block_tables=np.stack([arrays.block_tables for arrays in per_group]),
    )


# -- CUDA graph batch sizes and padding ----------------------------------------------------------
def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes graphs are captured for: the powers of two below
    ``max_num_seqs``, then ``max_num_seqs`` itself, so every decode batch the scheduler can
    form has a graph at most twice its size."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return (*sizes, max_num_seqs)


def padded_size(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of ``sizes`` (increasing) that holds ``num_seqs`` rows, or None."""
    return next((size for size in sizes if size >= num_seqs), None)


def graph_size(arrays: StepArrays, sizes: tuple[int, ...], block_size: int, table_width: int) -> int | None:
    """The captured batch size this step replays at, or None when it runs eagerly: a graph holds
    a decode step (one token per sequence, each sampled, prompt lengths known) of at most the
    largest size whose contexts fit its block tables of ``table_width`` blocks."""
    if arrays.max_query_len != 1 or not arrays.samples_every_row or arrays.prompt_lens is None:
        return None
    if -(-arrays.max_seq_len // block_size) > table_width:
        return None
    return padded_size(arrays.num_seqs, sizes)


def pad_decode(
    arrays: StepArrays, size: int, scratch_block: int, block_size: int, table_width: int
) -> StepArrays:
    """A decode step of ``size`` rows: ``arrays``' rows first, then padding rows, and block
    tables exactly ``table_width`` blocks wide (a real table cut past its context, which is
    never read, or filled with ``scratch_block``).

    A padding row is a one-token sequence of token 0 at position 0 whose key and value go to
    slot 0 of ``scratch_block`` and whose attention reads only that slot: a block the pool never
    hands out, so no live block is written, and rows never mix, so the real rows' outputs do not
    depend on the padding. Every row's logits are kept (the caller reads the first
    ``arrays.num_seqs``)."""
    real, pad = arrays.num_seqs, size - arrays.num_seqs
    if pad < 0 or (real and arrays.max_query_len != 1) or arrays.prompt_lens is None:
        raise ValueError(
            f"pad_decode pads a decode step with prompt lengths of at most {size} sequences, got "
            f"{real} sequences, a longest query of {arrays.max_query_len}"
        )
    tables = np.full((size, table_width), scratch_block, np.int32)
    width = min(table_width, arrays.block_tables.shape[1])
    tables[:real, :width] = arrays.block_tables[:, :width]
    return replace(
        arrays,
        input_ids=np.concatenate([arrays.input_ids, np.zeros(pad, np.int64)]),
        positions=np.concatenate([arrays.positions, np.zeros(pad, np.int64)]),
        slot_mapping=np.concatenate(
            [arrays.slot_mapping, np.full(pad, scratch_block * block_size, np.int64)]
        ),
        logits_indices=np.arange(size, dtype=np.int64),
        context_lens=np.concatenate([arrays.context_lens, np.ones(pad, np.int32)]),
        cu_seqlens_q=np.arange(size + 1, dtype=np.int32),
        block_tables=tables,
        prompt_lens=np.concatenate([arrays.prompt_lens, np.ones(pad, np.int32)]),
        max_query_len=1,
        max_seq_len=max(arrays.max_seq_len, 1),
    )


def empty_decode() -> StepArrays:
    """A decode step of no sequence: what :func:`pad_decode` fills with padding rows alone to
    capture a graph."""
    empty64, empty32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
    return StepArrays(
        input_ids=empty64,
        positions=empty64,
        slot_mapping=empty64,
        logits_indices=empty64,
        context_lens=empty32,
        cu_seqlens_q=np.zeros(1, np.int32),
        block_tables=np.zeros((0, 0), np.int32),
        prompt_lens=empty32,
        max_query_len=1,
        max_seq_len=1,
    )


# -- helpers ---------------------------------------------------------------------------------------
def _refuse(plan: StepPlan, tables: list[list[int] | None], bs: int, num_blocks: int) -> NoReturn:
    """Raise for the first slice without a block table, or whose table does not cover its
    positions with blocks of the pool (or that computes nothing)."""
    for i, (piece, table) in enumerate(zip(plan.slices, tables, strict=True)):
        start, end = piece.start, piece.end
        if table is None:
            raise ValueError(
                f"step plan slice {i} computes sequence {piece.seq_id!r}, whose table no plan sent"
            )
        used = table[: -(-end // bs)]  # the blocks the attention reads and the slots written
        if start < 0 or end <= start or len(used) * bs < end or min(used) < 0 or max(used) >= num_blocks:
            raise ValueError(
                f"step plan slice {i} computes positions {start}..{end - 1}, but its block table "
                f"{table} does not cover them with blocks of the pool's {num_blocks} "
                f"(block size {bs})"
            )
    raise ValueError(f"a step plan's block tables hold ids outside the pool's {num_blocks} blocks")
