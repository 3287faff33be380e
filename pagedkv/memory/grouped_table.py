"""A sequence's block tables under hybrid paging: one per KV group
(:mod:`pagedkv.memory.kv_groups`), a sliding group's table handing back what its window no
longer sees.

A :class:`WindowedBlockTable` keeps an entry for every logical block, like any table, but the
entries its window has left behind hold the pool's *null block* (vLLM's ``null_block``): one
block the manager takes at start and never frees nor writes, whose pages stay zero. A sliding
layer masks those positions, so it reads finite zeros there and never a stale page. The null
block counts no holder: tables put it in and take it out without touching its refcount.

A :class:`GroupedTable` is what the manager keeps per sequence: the group tables moving
together (same tokens, same capacity), all or nothing when the pool is short.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.block_table import BlockTable, CopyPair, blocks_for
from pagedkv.memory.errors import PoolExhaustedError
from pagedkv.memory.prefix_cache import ROOT


def first_needed_block(num_computed: int, window: int, block_size: int) -> int:
    """The first logical block a step starting at position ``num_computed`` still reads with a
    window of ``window`` tokens (a query at ``p`` sees keys ``> p - window``)."""
    return max(num_computed - window + 1, 0) // block_size


class WindowedBlockTable(BlockTable):
    """A block table whose leading entries, once out of the window, are ``null_block``.

    Invariant: entries ``[0, num_nulled)`` are ``null_block``, every later one a held block."""

    def __init__(
        self,
        pool: BlockPool,
        window: int,
        null_block: int,
        block_ids: Sequence[int] = (),
        num_tokens: int = 0,
        root: int = ROOT,
        num_nulled: int = 0,
    ) -> None:
        super().__init__(pool, block_ids, num_tokens, root)
        self.window = window
        self.null_block = null_block
        self.num_nulled = num_nulled
        #: False once a chain of this table left the prefix cache: what follows is not offered.
        self.cacheable = True

    def live_block_ids(self) -> list[int]:
        return self.block_ids[self.num_nulled :]

    def drop_out_of_window(self, num_computed: int) -> int:
        """Hand back the blocks no step from ``num_computed`` on reads; returns how many.

        Blocks go back front first, so cached ones join the LRU queue oldest first."""
        end = min(first_needed_block(num_computed, self.window, self.block_size), len(self.block_ids))
        if end <= self.num_nulled:
            return 0
        dropped = self.block_ids[self.num_nulled : end]
        self.block_ids[self.num_nulled : end] = [self.null_block] * len(dropped)
        self.num_nulled = end
        self.pool.free(dropped)
        return len(dropped)

    def truncate(self, num_tokens: int, free_blocks: bool = True) -> None:
        keep = blocks_for(num_tokens, self.block_size)
        if free_blocks and keep < self.num_nulled:
            raise ValueError(
                f"cannot truncate to {num_tokens} tokens: blocks before {self.num_nulled} are gone"
            )
        super().truncate(num_tokens, free_blocks)

    def fork(self) -> WindowedBlockTable:
        live = self.live_block_ids()
        for block in live:
            self.pool.incref(block)
        child = self._like(self.block_ids)
        child.num_cached_blocks, child.cacheable = self.num_cached_blocks, self.cacheable
        return child

    def private_copy(self) -> tuple[WindowedBlockTable, list[CopyPair]]:
        """A child holding private blocks where this one holds live ones (same capacity), and
        the copies of the written ones."""
        fresh = self.pool.allocate(len(self.block_ids) - self.num_nulled)
        child = self._like([self.null_block] * self.num_nulled + fresh)
        written = blocks_for(self.num_tokens, self.block_size)
        return child, list(zip(self.block_ids[self.num_nulled : written], fresh, strict=False))

    def _like(self, block_ids: list[int]) -> WindowedBlockTable:
        return WindowedBlockTable(
            self.pool, self.window, self.null_block, block_ids, self.num_tokens, self.root, self.num_nulled
        )

    def free(self) -> None:
        self.pool.free(reversed(self.live_block_ids()))
        self.block_ids = []
        self.num_tokens = 0
        self.num_cached_blocks = 0
        self.num_nulled = 0


class GroupedTable:
    """One table per KV group, moving together; ``block_ids`` interleaves them (logical block
    ``i`` of group ``g`` at ``i * num_groups + g``): what the runners are sent, one list per
    sequence."""

    def __init__(self, tables: list[BlockTable]) -> None:
        self.tables = tables
        self.pool = tables[0].pool

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_tokens(self) -> int:
        return self.tables[0].num_tokens

    @property
    def capacity(self) -> int:
        return self.tables[0].capacity

    @property
    def root(self) -> int:
        return self.tables[0].root

    @property
    def block_ids(self) -> list[int]:
        return [block for row in zip(*(t.block_ids for t in self.tables), strict=True) for block in row]

    def live_block_ids(self) -> list[int]:
        """Every held block of every group (the null block left out)."""
        return [
            b
            for t in self.tables
            for b in (t.live_block_ids() if isinstance(t, WindowedBlockTable) else t.block_ids)
        ]

    def blocks_needed(self, n: int) -> int:
        return sum(t.blocks_needed(n) for t in self.tables)

    def try_append(self, n: int) -> list[CopyPair] | None:
        if self.blocks_needed(n) > self.pool.num_free_blocks:
            return None
        copies: list[CopyPair] = []
        for table in self.tables:
            copies += table.append_slots(n)
        return copies

    def append_slots(self, n: int) -> list[CopyPair]:
        copies = self.try_append(n)
        if copies is None:
            raise PoolExhaustedError(self.blocks_needed(n), self.pool.num_free_blocks, self.pool.num_blocks)
        return copies

    def truncate(self, num_tokens: int, free_blocks: bool = True) -> None:
        for table in self.tables:
            table.truncate(num_tokens, free_blocks)

    def reserve(self, num_tokens: int) -> None:
        missing = sum(max(blocks_for(num_tokens, self.block_size) - len(t.block_ids), 0) for t in self.tables)
        if missing > self.pool.num_free_blocks:
            raise PoolExhaustedError(missing, self.pool.num_free_blocks, self.pool.num_blocks)
        for table in self.tables:
            table.reserve(num_tokens)

    def fork(self) -> GroupedTable:
        return GroupedTable([t.fork() for t in self.tables])

    def free(self) -> None:
        for table in self.tables:
            table.free()

    def drop_out_of_window(self, num_computed: int) -> int:
        """Every sliding group's blocks out of its window back to the pool; how many."""
        return sum(
            t.drop_out_of_window(num_computed) for t in self.tables if isinstance(t, WindowedBlockTable)
        )
