"""The model runner's copy of every sequence's block table, kept in step by the plans' edits.

vLLM's worker-side ``BlockTable``: the driver sends each table once, then what changed
(:class:`~pagedkv.engine.core.plan.TableEdit`), and every runner -- one per tensor-parallel rank --
applies the same edits, so every rank's tables equal the driver's
(:class:`~pagedkv.engine.core.plan.ShippedTables`) as long as it applied every plan since the last
reset. Each table lives twice: a Python list, which the step's slot arithmetic indexes, and a
row of one int32 array, from which a step's padded block tables are one gather instead of a
build from lists. A row's entries past its table are 0 (a block id of any pool, never read).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pagedkv.engine.core.plan import SeqId, StepPlan


class RunnerTables:
    """Every sequence's block table as the plans' edits made it (see the module docstring)."""

    def __init__(self, rows: int = 8, width: int = 16) -> None:
        self._tables: dict[SeqId, list[int]] = {}
        self._rows: dict[SeqId, int] = {}  # each table's row of the array
        self._array = np.zeros((rows, width), np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first

    def clear(self) -> None:
        """Forget every table (the array keeps its size)."""
        self._tables.clear()
        self._rows.clear()
        self._array[:] = 0
        self._free_rows = list(range(self._array.shape[0] - 1, -1, -1))

    def apply(self, plan: StepPlan) -> None:
        """The plan's changes, in its order: reset, finished, edits. An edit that keeps more
        blocks than the runner holds (a plan missed) is a ValueError."""
        if plan.reset:
            self.clear()
        for seq_id in plan.finished:
            table = self._tables.pop(seq_id, None)
            if table is not None:
                row = self._rows.pop(seq_id)
                self._array[row, : len(table)] = 0
                self._free_rows.append(row)
        for edit in plan.table_edits:
            table = self._tables.get(edit.seq_id)
            if edit.keep == 0 and table is None:
                table = self._tables[edit.seq_id] = []
                self._rows[edit.seq_id] = self._take_row()
            elif table is None or len(table) < edit.keep:
                raise ValueError(
                    f"a plan keeps {edit.keep} blocks of sequence {edit.seq_id!r}'s table, but the "
                    f"runner holds {'none' if table is None else len(table)}: it missed a plan"
                )
            row = self._rows[edit.seq_id]
            self._array[row, edit.keep : len(table)] = 0
            del table[edit.keep :]
            table += edit.new_block_ids
            if len(table) > self._array.shape[1]:
                self._grow(self._array.shape[0], max(len(table), 2 * self._array.shape[1]))
            self._array[row, edit.keep : len(table)] = edit.new_block_ids

    def padded(self, seq_ids: list[SeqId], width: int, group: int = 0, num_groups: int = 1) -> np.ndarray:
        """The tables of ``seq_ids`` as a new ``[len(seq_ids), width]`` int32 array, each padded
        with 0 (``width``: the longest of them); of tables interleaving ``num_groups`` KV groups,
        group ``group``'s."""
        rows = [self._rows[seq_id] for seq_id in seq_ids]
        if num_groups == 1:
            return self._array[rows, :width]
        return self._array[rows, group : width * num_groups : num_groups]

    def group(self, group: int, num_groups: int) -> GroupTables:
        """KV group ``group``'s tables, out of tables interleaving ``num_groups`` groups."""
        return GroupTables(self, group, num_groups)

    def get(self, seq_id: SeqId) -> list[int] | None:
        return self._tables.get(seq_id)

    def __getitem__(self, seq_id: SeqId) -> list[int]:
        return self._tables[seq_id]

    def __iter__(self) -> Iterator[SeqId]:
        return iter(self._tables)

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self._array.shape[0]
            self._grow(2 * rows, self._array.shape[1])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int, width: int) -> None:
        grown = np.zeros((rows, width), np.int32)
        grown[: self._array.shape[0], : self._array.shape[1]] = self._array
        self._array = grown


class GroupTables:
    """One KV group's block tables, read out of :class:`RunnerTables` whose tables interleave
    the groups' (logical block ``i`` of group ``g`` at ``i * num_groups + g``, what a
    :class:`~pagedkv.memory.grouped_table.GroupedTable` sends): the ``get`` and ``padded`` a
    step's arrays read."""

    def __init__(self, tables: RunnerTables, group: int, num_groups: int) -> None:
        self.tables, self.group, self.num_groups = tables, group, num_groups

    def get(self, seq_id: SeqId) -> list[int] | None:
        table = self.tables.get(seq_id)
        return None if table is None else table[self.group :: self.num_groups]

    def padded(self, seq_ids: list[SeqId], width: int) -> np.ndarray:
        return self.tables.padded(seq_ids, width, self.group, self.num_groups)
