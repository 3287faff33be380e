"""A sequence's block tables under hybrid paging: one per KV group
(:mod:`pagedkv.memory.kv_groups`), a sliding group's table handing back what its window no
longer sees.

A :class:`WindowedBlockTable` keeps an entry for every logical block, like any table, but the
entries its window has left behind hold the pool's *null block* (vLLM's ``null_block``): one
block the manager takes at start and never frees nor writes, whose pages stay zero. A sliding
layer masks those positions, so it reads finite zeros there and never a stale page. The null
block counts no holder: tables put it in and take it out without touching its refcount.

Its trailing entries may hold the null block too, as *pending* ones: prompt blocks no step has
reached yet. A prompt is allocated chunk by chunk in a sliding group (vLLM's per-step
``allocate_slots``): :meth:`WindowedBlockTable.hold` takes blocks for the positions a step
writes just before it, once the blocks its window left are handed back, so a long prompt never
holds more than a window and a chunk. Causal attention reads no position past the step's last,
so a pending entry is never read.

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

    Invariant: entries ``[0, num_nulled)`` and the last ``num_pending`` are ``null_block``, every
    one between them a held block."""

    def __init__(
        self,
        pool: BlockPool,
        window: int,
        null_block: int,
        block_ids: Sequence[int] = (),
        num_tokens: int = 0,
        root: int = ROOT,
        num_nulled: int = 0,
        num_pending: int = 0,
    ) -> None:
        super().__init__(pool, block_ids, num_tokens, root)
        self.window = window
        self.null_block = null_block
        self.num_nulled = num_nulled
        self.num_pending = num_pending
        #: False once a chain of this table left the prefix cache: what follows is not offered.
        self.cacheable = True

    @property
    def held_end(self) -> int:
        """The entry after the last held block (where the pending entries start)."""
        return len(self.block_ids) - self.num_pending

    def live_block_ids(self) -> list[int]:
        return self.block_ids[self.num_nulled : self.held_end]

    def extend_pending(self, num_tokens: int) -> None:
        """Cover ``num_tokens`` tokens, the entries past the held ones pending (no block yet)."""
        missing = blocks_for(num_tokens, self.block_size) - len(self.block_ids)
        if missing > 0:
            self.block_ids += [self.null_block] * missing
            self.num_pending += missing
        self.num_tokens = max(self.num_tokens, num_tokens)

    def blocks_to_hold(self, end: int) -> int:
        """New blocks :meth:`hold` takes for a step ending at position ``end``."""
        return max(min(blocks_for(end, self.block_size), len(self.block_ids)) - self.held_end, 0)

    def hold(self, end: int) -> None:
        """Give the pending entries a step ending at position ``end`` writes their blocks (the
        caller checked :meth:`blocks_to_hold` against the pool)."""
        missing = self.blocks_to_hold(end)
        if missing:
            start = self.held_end
            self.block_ids[start : start + missing] = self.pool.allocate(missing)
            self.num_pending -= missing

    def blocks_needed(self, n: int) -> int:
        if n <= 0:
            return 0
        return super().blocks_needed(n) + self.num_pending

    def try_append(self, n: int) -> list[CopyPair] | None:
        """:meth:`BlockTable.try_append`, every pending entry held first (an append comes once
        the prompt is computed, when none is left)."""
        if self.num_pending:
            if n > 0 and self.blocks_needed(n) > self.pool.num_free_blocks:
                return None
            self.hold(len(self.block_ids) * self.block_size)
        return super().try_append(n)

    def drop_out_of_window(self, num_computed: int) -> int:
        """Hand back the blocks no step from ``num_computed`` on reads; returns how many.

        Blocks go back front first, so cached ones join the LRU queue oldest first. Pending
        entries the window has passed become null ones."""
        end = min(first_needed_block(num_computed, self.window, self.block_size), len(self.block_ids))
        if end <= self.num_nulled:
            return 0
        held_end = self.held_end
        dropped = self.block_ids[self.num_nulled : min(end, held_end)]
        self.block_ids[self.num_nulled : end] = [self.null_block] * (end - self.num_nulled)
        self.num_pending -= max(end - held_end, 0)
        self.num_nulled = end
        self.pool.free(dropped)
        return len(dropped)

    def truncate(self, num_tokens: int, free_blocks: bool = True) -> None:
        keep = blocks_for(num_tokens, self.block_size)
        if free_blocks and keep < self.num_nulled:
            raise ValueError(
                f"cannot truncate to {num_tokens} tokens: blocks before {self.num_nulled} are gone"
            )
        if free_blocks and self.num_pending:  # pending entries past the kept tokens hold nothing
            cut = max(keep, self.held_end)
            self.num_pending -= len(self.block_ids) - cut
            del self.block_ids[cut:]
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
        fresh = self.pool.allocate(self.held_end - self.num_nulled)
        child = self._like([self.null_block] * self.num_nulled + fresh + [self.null_block] * self.num_pending)
        written = min(blocks_for(self.num_tokens, self.block_size), self.held_end)
        return child, list(zip(self.block_ids[self.num_nulled : written], fresh, strict=False))

    def _like(self, block_ids: list[int]) -> WindowedBlockTable:
        return WindowedBlockTable(
            self.pool,
            self.window,
            self.null_block,
            block_ids,
            self.num_tokens,
            self.root,
            self.num_nulled,
            self.num_pending,
        )

    def free(self) -> None:
        self.pool.free(reversed(self.live_block_ids()))
        self.block_ids = []
        self.num_tokens = 0
        self.num_cached_blocks = 0
        self.num_nulled = 0
        self.num_pending = 0


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

    def windowed(self) -> list[WindowedBlockTable]:
        return [t for t in self.tables if isinstance(t, WindowedBlockTable)]

    def try_hold(self, start: int, end: int) -> bool:
        """Blocks for a step computing positions ``start .. end - 1`` in every sliding group,
        once the blocks its window left are back in the pool; False (only those handed back)
        when the pool is short."""
        self.drop_out_of_window(start)
        windowed = self.windowed()
        if sum(t.blocks_to_hold(end) for t in windowed) > self.pool.num_free_blocks:
            return False
        for table in windowed:
            table.hold(end)
        return True

    def drop_out_of_window(self, num_computed: int) -> int:
        """Every sliding group's blocks out of its window back to the pool; how many."""
        return sum(t.drop_out_of_window(num_computed) for t in self.windowed())
