"""The KV cache manager of a model with sliding-window layers: a table per KV group, one pool.

vLLM v1's hybrid KV cache manager (``KVCacheCoordinator`` over one ``SingleTypeKVCacheManager``
per group). Each sequence holds a :class:`~pagedkv.memory.grouped_table.GroupedTable`: a full
group's table keeps every block; a sliding group's table hands a block back to the pool once
no later step reads it (after each step, at :meth:`cache_computed_blocks`, as vLLM's
``SlidingWindowManager.remove_skipped_blocks``), leaving the null block in its place.

Given the most tokens a step computes for one sequence (``max_chunk_tokens``, the scheduler's
token budget), admission allocates a prompt whole in the full groups but, in the sliding
groups, only up to where its first step can end; each later step of the prompt takes its
blocks at :meth:`try_hold`, after its window's old ones went back. A sliding group then holds at
most a window and a chunk of a prompt, never the whole of it. A reservation past the prompt
(the contiguous policies) is allocated whole in every group.

The prefix cache keeps each group's chain under its own root (the request's root for group 0,
one derived from it and the group for the others), so a group shares only blocks of its own
layers. A prompt's hit is the longest prefix every group still holds from its root: a full
group's chain as before, a sliding group's chain whole, of which the new table shares only
the blocks the window still reads (the rest become null entries). A sliding chain loses its
first blocks first (they are freed first, so evicted first) and with them the rest: a windowed
prefix is then recomputed -- correct, if more often than vLLM's search from the right.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from pagedkv.memory.block_hash import salted_root
from pagedkv.memory.block_table import BlockTable, CopyPair, blocks_for
from pagedkv.memory.errors import PoolExhaustedError
from pagedkv.memory.grouped_table import GroupedTable, WindowedBlockTable, first_needed_block
from pagedkv.memory.kv_groups import KVGroups
from pagedkv.memory.manager import KVCacheManager, KVUsage, PoolSnapshot, SeqId, TableSnapshot
from pagedkv.memory.prefix_cache import root_of


def group_root(cache_salt: str | None, group: int) -> int:
    """The prefix-cache root of group ``group``'s first block for a request salted
    ``cache_salt``: the request's own root for group 0, a root of the group's for the others."""
    if group == 0:
        return root_of(cache_salt)
    root = salted_root(f"{cache_salt if cache_salt is not None else ''}\x00kv group {group}")
    assert root is not None
    return root


def group_peak_blocks(
    groups: KVGroups, block_size: int, max_chunk_tokens: int | None, admitted_tokens: int, final_tokens: int
) -> int:
    """The most blocks of ``groups`` one sequence holds at once, ``admitted_tokens`` allocated at admission
    and ``final_tokens`` at its end (the null block aside). A full group holds what admission
    allocates, then grows to the final tokens. A sliding group holds, once its prompt is computed, a
    window's blocks and the one a boundary adds before the step's end hands the oldest back; while
    the prompt is computed chunk by chunk (admission allocating the prompt only, as a paged policy
    does), a window and a chunk of ``max_chunk_tokens`` at most, else what admission allocates."""
    admitted, final = (blocks_for(n, block_size) for n in (admitted_tokens, final_tokens))
    chunked = max_chunk_tokens is not None and admitted_tokens < final_tokens
    peak = 0
    for window in groups.windows:
        if window is None:
            peak += max(admitted, final)
            continue
        reach = min(final, blocks_for(window, block_size) + 2)
        if chunked:
            step = blocks_for(window + max_chunk_tokens, block_size) + 2
            peak += max(reach, min(admitted, step))
        else:
            peak += max(admitted, reach)
    return peak


class HybridKVCacheManager(KVCacheManager):
    """:class:`KVCacheManager` with one table per KV group of ``groups`` (module docstring).

    Block 0 is the null block: taken at start, never freed, never written."""

    def __init__(
        self,
        num_blocks: int,
        groups: KVGroups,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        max_chunk_tokens: int | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"hybrid paging needs a block beside the null block, got {num_blocks} blocks")
        if max_chunk_tokens is not None and max_chunk_tokens <= 0:
            raise ValueError(f"max_chunk_tokens must be positive, got {max_chunk_tokens}")
        super().__init__(num_blocks, block_size, enable_prefix_caching, watermark)
        self.groups = groups
        #: The most tokens one step computes for a sequence; None: prompts are allocated whole.
        self.max_chunk_tokens = max_chunk_tokens
        (self.null_block,) = self.pool.allocate(1)

    # -- tables -----------------------------------------------------------------------------
    def _new_table(self, group: int, block_ids: list[int], num_tokens: int, root: int) -> BlockTable:
        window = self.groups.windows[group]
        if window is None:
            return BlockTable(self.pool, block_ids, num_tokens, root)
        return WindowedBlockTable(self.pool, window, self.null_block, block_ids, num_tokens, root)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return self.groups.windows

    def grouped(self, seq_id: SeqId) -> GroupedTable:
        table = self.table(seq_id)
        assert isinstance(table, GroupedTable)
        return table

    # -- admission --------------------------------------------------------------------------
    def _group_hits(self, token_ids: Sequence[int], use_cache: bool, salt: str | None) -> list[list[int]]:
        """Per group, the cached blocks a prompt's table starts with (null entries for what a
        window no longer reads), all groups the same length."""
        groups = range(self.groups.num_groups)
        if not (self.enable_prefix_caching and use_cache):
            return [[] for _ in groups]
        limit = (len(token_ids) - 1) // self.block_size
        chains = [self.pool.match_prefix(token_ids, limit, group_root(salt, g)) for g in groups]
        hit = min(len(chain) for chain in chains)
        hits = []
        for g, chain in enumerate(chains):
            window = self.groups.windows[g]
            nulled = (
                0
                if window is None
                else min(first_needed_block(hit * self.block_size, window, self.block_size), hit)
            )
            hits.append([self.null_block] * nulled + chain[nulled:hit])
        return hits

    def _cached_prefix(
        self, token_ids: Sequence[int], use_cache: bool, cache_salt: str | None = None
    ) -> list[int]:
        """The cached blocks an allocation would share, every group's (no null block)."""
        return [
            b
            for hits in self._group_hits(token_ids, use_cache, cache_salt)
            for b in hits
            if b != self.null_block
        ]

    def blocks_to_allocate(
        self,
        token_ids: Sequence[int],
        reserve_tokens: int = 0,
        use_cache: bool = True,
        cache_salt: str | None = None,
    ) -> int:
        hits = self._group_hits(token_ids, use_cache, cache_salt)
        step_end = self._first_step_end(len(token_ids), len(hits[0]) * self.block_size, reserve_tokens)
        return self._new_blocks(hits, max(len(token_ids), reserve_tokens), step_end)

    def _first_step_end(self, num_tokens: int, cached_tokens: int, reserve_tokens: int) -> int | None:
        """Where the first step of a prompt can end at the latest: what its sliding groups hold
        at admission (None: the whole prompt and reservation, in every group)."""
        if self.max_chunk_tokens is None or reserve_tokens > num_tokens:
            return None
        return min(num_tokens, cached_tokens + self.max_chunk_tokens)

    def _new_blocks(self, hits: list[list[int]], total_tokens: int, step_end: int | None) -> int:
        """Blocks taken from the free pool: every group's new blocks and revived cached ones."""
        logical = blocks_for(total_tokens, self.block_size)
        held_now = logical if step_end is None else blocks_for(step_end, self.block_size)
        shared = [b for group in hits for b in group if b != self.null_block]
        revived = sum(1 for b in shared if self.pool.refcount(b) == 0)
        entries = sum(logical if w is None else held_now for w in self.groups.windows)
        return entries - sum(len(group) for group in hits) + revived

    def _allocate_prompt(
        self, seq_id: SeqId, token_ids: Sequence[int], reserve: int, use_cache: bool, salt: str | None
    ) -> int:
        hits = self._group_hits(token_ids, use_cache, salt)
        step_end = self._first_step_end(len(token_ids), len(hits[0]) * self.block_size, reserve)
        needed = self._new_blocks(hits, max(len(token_ids), reserve), step_end)
        if needed > self.pool.num_free_blocks:
            raise PoolExhaustedError(needed, self.pool.num_free_blocks, self.num_blocks)
        cached_tokens = len(hits[0]) * self.block_size
        tables = []
        for g, group_hits in enumerate(hits):
            for block in group_hits:
                if block != self.null_block:
                    self.pool.incref(block)
            table = self._new_table(g, group_hits, cached_tokens, group_root(salt, g))
            if isinstance(table, WindowedBlockTable):
                table.num_nulled = group_hits.count(self.null_block)
            table.num_cached_blocks = len(group_hits)
            tables.append(table)
        grouped = GroupedTable(tables)
        if step_end is None:
            grouped.append_slots(len(token_ids) - cached_tokens)
            grouped.reserve(reserve)
        else:
            for table in tables:
                if isinstance(table, WindowedBlockTable):
                    table.extend_pending(len(token_ids))
                    table.hold(step_end)
                else:
                    table.append_slots(len(token_ids) - cached_tokens)
        self._tables[seq_id] = grouped
        if self.enable_prefix_caching and use_cache:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += cached_tokens
        return cached_tokens

    def try_hold(self, seq_id: SeqId, start: int, end: int) -> bool:
        """The sliding groups' blocks for a step computing ``start .. end - 1``, taken once their
        windows' old blocks went back (those go back even when the pool is short)."""
        return self.grouped(seq_id).try_hold(start, end)

    # -- sharing ----------------------------------------------------------------------------
    def fork(self, parent_id: SeqId, child_id: SeqId, share: bool = True) -> list[CopyPair]:
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already holds KV blocks")
        parent = self.grouped(parent_id)
        if share:
            self._tables[child_id] = parent.fork()
            return []
        needed = len(parent.live_block_ids())
        if needed > self.pool.num_free_blocks:
            raise PoolExhaustedError(needed, self.pool.num_free_blocks, self.num_blocks)
        tables: list[BlockTable] = []
        copies: list[CopyPair] = []
        for table in parent.tables:
            if isinstance(table, WindowedBlockTable):
                child, pairs = table.private_copy()
            else:
                child = BlockTable(
                    self.pool, self.pool.allocate(len(table.block_ids)), table.num_tokens, table.root
                )
                written = blocks_for(table.num_tokens, self.block_size)
                pairs = list(zip(table.block_ids[:written], child.block_ids[:written], strict=True))
            tables.append(child)
            copies += pairs
        self._tables[child_id] = GroupedTable(tables)
        return copies

    # -- after a step -------------------------------------------------------------------------
    def cache_computed_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_computed: int) -> None:
        """Offer each group's newly computed full blocks to the prefix cache, then hand back the
        blocks the sliding groups' windows have left (the next step starts at ``num_computed``)."""
        grouped = self.grouped(seq_id)
        if self.enable_prefix_caching:
            for table in grouped.tables:
                self._cache_group(table, token_ids, num_computed)
        grouped.drop_out_of_window(min(num_computed, grouped.num_tokens))

    def _cache_group(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        full = min(num_computed, len(token_ids), table.num_tokens) // self.block_size
        done = table.num_cached_blocks
        if full <= done:
            return
        windowed = isinstance(table, WindowedBlockTable)
        if windowed and not table.cacheable:
            return
        in_cache = not done or table.block_ids[done - 1] in self.pool.prefix_cache
        if windowed and (done < table.num_nulled or not in_cache):
            table.cacheable = False  # its chain's start is gone with the window: nothing after it is findable
            return
        self._register_blocks(table, token_ids, done if in_cache else 0, full)

    # -- reporting --------------------------------------------------------------------------
    def usage(self) -> KVUsage:
        """The pool less the null block, which holds no sequence's data."""
        usage = super().usage()
        return dataclasses.replace(
            usage, total_blocks=usage.total_blocks - 1, used_blocks=usage.used_blocks - 1
        )

    def peak_blocks(self, admitted_tokens: int, final_tokens: int) -> int:
        """:func:`group_peak_blocks` for this manager's groups, blocks and chunks."""
        return group_peak_blocks(
            self.groups, self.block_size, self.max_chunk_tokens, admitted_tokens, final_tokens
        )

    def held_blocks(self, seq_id: SeqId) -> int:
        return len(self.grouped(seq_id).live_block_ids())

    def private_blocks(self, seq_id: SeqId, shared_soon: Collection[int] = ()) -> int:
        blocks = self.grouped(seq_id).live_block_ids()
        return sum(1 for b in blocks if self.pool.refcount(b) == 1 and b not in shared_soon)

    def num_table_blocks(self) -> int:
        """Blocks the tables hold, a shared block once per holder (null entries left out)."""
        return sum(len(t.live_block_ids()) for t in self._tables.values())  # type: ignore[attr-defined]

    def snapshot(self) -> PoolSnapshot:
        tables = {
            seq: TableSnapshot(
                tuple(t.live_block_ids()),  # type: ignore[attr-defined]
                t.num_tokens,
                tuple(tuple(group.block_ids) for group in t.tables),  # type: ignore[attr-defined]
            )
            for seq, t in self._tables.items()
        }
        pool = self.pool
        return PoolSnapshot(self.block_size, pool.refcounts(), frozenset(pool.prefix_cache.blocks()), tables)
