"""The narrow API the scheduler uses: sequences in, block tables and slots out.

The scheduler never touches a block; it asks this manager whether a sequence fits, to allocate
its prompt (reusing cached prefix blocks), to grow it by a token, to fork it, and to free it.

A request's ``cache_salt`` (vLLM's) picks the prefix-cache root its blocks are chained under
(:func:`~pagedkv.memory.prefix_cache.root_of`): a prompt finds only blocks cached under the same
salt, or, unsalted, only unsalted ones. Its table keeps the root, and so do its forks.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

from pagedkv.memory.block_pool import BlockPool, KVCacheListener
from pagedkv.memory.block_table import BlockTable, CopyPair, blocks_for
from pagedkv.memory.errors import PoolExhaustedError
from pagedkv.memory.prefix_cache import root_of
from pagedkv.memory.tier.transfers import KVTransfers

SeqId = Hashable


@dataclass(frozen=True)
class Preemption:
    """How a sequence left the pool: ``swapped`` (its computed tokens are kept and come back at
    readmission) or recomputed; ``blocks_moved`` blocks were copied out."""

    swapped: bool
    blocks_moved: int
    tokens_kept: int


@dataclass(frozen=True)
class TableSnapshot:
    """A table's held blocks and tokens; with KV groups, each group's table too (logical block
    ``i`` at index ``i``, the null block where a window passed or a prompt chunk is to come)."""

    block_ids: tuple[int, ...]
    num_tokens: int
    groups: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class PoolSnapshot:
    """Every block's refcount, the blocks whose contents the prefix cache holds, and every
    table: a copy, safe to keep while the pool moves on."""

    block_size: int
    refcounts: tuple[int, ...]
    cached: frozenset[int]
    tables: dict[SeqId, TableSnapshot]


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the pool, in blocks. ``utilization`` is in-use blocks / total."""

    total_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    cached_free_blocks: int
    block_size: int

    @property
    def utilization(self) -> float:
        return self.used_blocks / self.total_blocks


class KVCacheManager:
    """Owns the block pool and one :class:`BlockTable` per live sequence."""

    #: The block no table holds but whose entries point at it (KV groups' null block); None here.
    null_block: int | None = None

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        hash_blocks: bool = False,
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.pool = BlockPool(num_blocks, block_size, hash_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        #: Blocks kept free at admission so running sequences can still grow a little.
        self.watermark_blocks = int(watermark * num_blocks)
        self._tables: dict[SeqId, BlockTable] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Per KV group, its layers' window (None: full attention); empty: one table per
        sequence, every layer in it."""
        return ()

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def table(self, seq_id: SeqId) -> BlockTable:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} holds no KV blocks") from None

    def block_ids(self, seq_id: SeqId) -> list[int]:
        return self.table(seq_id).block_ids

    # -- admission --------------------------------------------------------------------------
    def _cached_prefix(
        self, token_ids: Sequence[int], use_cache: bool, cache_salt: str | None = None
    ) -> list[int]:
        if not (self.enable_prefix_caching and use_cache):
            return []
        # Never cover the prompt's last token: its logits must come out of this step.
        return self.pool.match_prefix(token_ids, (len(token_ids) - 1) // self.block_size, root_of(cache_salt))

    def blocks_to_allocate(
        self,
        token_ids: Sequence[int],
        reserve_tokens: int = 0,
        use_cache: bool = True,
        cache_salt: str | None = None,
    ) -> int:
        """New blocks a prompt would take after its cache hits (hits still count as used).

        ``reserve_tokens`` asks for slots beyond the prompt up front (contiguous reservation);
        ``use_cache=False`` looks nothing up (a prompt that must compute every token);
        ``cache_salt`` looks up only the blocks cached under that salt.
        """
        hits = self._cached_prefix(token_ids, use_cache, cache_salt)
        revived = sum(1 for b in hits if self.pool.refcount(b) == 0)
        total = max(len(token_ids), reserve_tokens)
        return blocks_for(total, self.block_size) - len(hits) + revived

    @property
    def allocatable_blocks(self) -> int:
        """Free blocks an admission may take: all but the watermark."""
        return self.pool.num_free_blocks - self.watermark_blocks

    def allocate(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        reserve_tokens: int = 0,
        use_cache: bool = True,
        cache_salt: str | None = None,
    ) -> int:
        """Give ``seq_id`` blocks for its whole prompt; return how many tokens were cached.

        Cached prefix blocks are shared (refcount + 1) instead of allocated; the caller skips
        computing those tokens. ``reserve_tokens`` holds slots for later tokens too;
        ``use_cache=False`` allocates every block new (the blocks are still offered to the
        cache once computed); ``cache_salt`` shares and caches blocks only under that salt.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds KV blocks")
        return self._allocate_prompt(seq_id, token_ids, reserve_tokens, use_cache, cache_salt)

    def _allocate_prompt(
        self, seq_id: SeqId, token_ids: Sequence[int], reserve: int, use_cache: bool, salt: str | None
    ) -> int:
        """:meth:`allocate` for a sequence that holds no blocks."""
        hits = self._cached_prefix(token_ids, use_cache, salt)
        self._allocate_with_hits(seq_id, token_ids, hits, reserve, salt)
        cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching and use_cache:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += cached_tokens
        return cached_tokens

    def _allocate_with_hits(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        hits: list[int],
        reserve_tokens: int,
        cache_salt: str | None = None,
    ) -> BlockTable:
        """A table for ``token_ids`` whose first blocks are the cached ``hits`` (shared) and the
        rest new; all or nothing."""
        revived = sum(1 for b in hits if self.pool.refcount(b) == 0)
        needed = blocks_for(max(len(token_ids), reserve_tokens), self.block_size) - len(hits) + revived
        if needed > self.pool.num_free_blocks:
            raise PoolExhaustedError(needed, self.pool.num_free_blocks, self.num_blocks)
        for block in hits:
            self.pool.incref(block)
        table = BlockTable(self.pool, hits, len(hits) * self.block_size, root_of(cache_salt))
        table.num_cached_blocks = len(hits)
        table.append_slots(len(token_ids) - table.num_tokens)
        table.reserve(reserve_tokens)
        self._tables[seq_id] = table
        return table

    # -- growth, sharing, release -----------------------------------------------------------
    def can_append(self, seq_id: SeqId, n: int = 1) -> bool:
        return self.table(seq_id).blocks_needed(n) <= self.pool.num_free_blocks

    def append_slots(self, seq_id: SeqId, n: int = 1) -> list[CopyPair]:
        """Grow ``seq_id`` by ``n`` tokens; returns copy-on-write block copies to perform."""
        return self.table(seq_id).append_slots(n)

    def try_append(self, seq_id: SeqId, n: int = 1) -> list[CopyPair] | None:
        """Grow ``seq_id`` by ``n`` tokens if the pool allows (its block copies), else None."""
        return self.table(seq_id).try_append(n)

    def try_hold(self, seq_id: SeqId, start: int, end: int) -> bool:
        """Hold the blocks a step computing ``seq_id``'s positions ``start .. end - 1`` writes,
        or answer False (the pool is short). Admission allocated a whole prompt here, so this
        holds nothing; a manager that allocates prompts chunk by chunk takes them now."""
        return True

    def truncate(self, seq_id: SeqId, num_tokens: int, free_blocks: bool = True) -> None:
        """Shrink ``seq_id`` to its first ``num_tokens`` tokens (speculative tokens the target
        model rejected); see :meth:`BlockTable.truncate`."""
        self.table(seq_id).truncate(num_tokens, free_blocks)

    def fork(self, parent_id: SeqId, child_id: SeqId, share: bool = True) -> list[CopyPair]:
        """``child_id`` gets ``parent_id``'s tokens: shared blocks (parallel samples, beams), or,
        with ``share=False``, private blocks of the same capacity and the copies to fill them."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already holds KV blocks")
        parent = self.table(parent_id)
        if share:
            self._tables[child_id] = parent.fork()
            return []
        if len(parent.block_ids) > self.pool.num_free_blocks:
            raise PoolExhaustedError(len(parent.block_ids), self.pool.num_free_blocks, self.num_blocks)
        child = BlockTable(self.pool, root=parent.root)
        child.append_slots(parent.num_tokens)
        child.reserve(parent.capacity)
        self._tables[child_id] = child
        written = blocks_for(parent.num_tokens, self.block_size)
        return list(zip(parent.block_ids[:written], child.block_ids[:written], strict=True))

    def free(self, seq_id: SeqId) -> None:
        """Release ``seq_id``'s blocks; cached ones stay reusable until evicted. Idempotent."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            table.free()

    def preempt(
        self, seq_id: SeqId, token_ids: Sequence[int], num_computed: int, allow_swap: bool = True
    ) -> Preemption:
        """Take ``seq_id``'s blocks back to make room: without a second tier it recomputes what
        the prefix cache does not keep (a tiered manager may swap its blocks out instead)."""
        self.free(seq_id)
        return Preemption(False, 0, 0)

    def swap_ready(self, seq_id: SeqId) -> bool:
        """Whether ``seq_id`` may be admitted now (a swap-out still being written may not)."""
        return True

    def take_transfers(self) -> KVTransfers | None:
        """The moves to a second tier planned since the last call (None: no tier)."""
        return None

    def cache_computed_blocks(self, seq_id: SeqId, token_ids: Sequence[int], num_computed: int) -> None:
        """Register ``seq_id``'s full blocks whose keys/values are now computed.

        Called after a step, so a block is only ever offered to other requests once its data
        is really in the cache.
        """
        if not self.enable_prefix_caching:
            return
        table = self.table(seq_id)
        full = min(num_computed, len(token_ids), table.num_tokens) // self.block_size
        done = table.num_cached_blocks
        if full <= done:  # no block filled up since: the common case, 15 steps in 16 at decode
            return
        if done and table.block_ids[done - 1] not in self.pool.prefix_cache:
            done = 0  # a reset forgot this chain: register it again from the start
        self._register_blocks(table, token_ids, done, full)

    def _register_blocks(self, table: BlockTable, token_ids: Sequence[int], done: int, full: int) -> None:
        """Offer ``table``'s blocks ``done..full-1`` (computed, full, chained to block ``done - 1``)
        to the prefix cache; one another sequence cached first replaces ours in the table."""
        bs = self.block_size
        cache = self.pool.prefix_cache
        for i in range(done, full):
            parent = table.block_ids[i - 1] if i else table.root
            block, tokens = table.block_ids[i], token_ids[i * bs : (i + 1) * bs]
            twin = cache.lookup(parent, tokens)
            if twin is None:
                if block not in cache:
                    self.pool.cache_block(block, parent, tokens)
            elif twin != block:
                # Another sequence computed the same prefix first: share its block, drop ours.
                self.pool.incref(twin)
                self.pool.free([block])
                table.block_ids[i] = twin
        table.num_cached_blocks = max(done, full)

    def set_listener(self, listener: KVCacheListener | None) -> None:
        """Tell ``listener`` of every block the prefix cache gains or loses (None: nobody)."""
        self.pool.listener = listener

    def reset_prefix_cache(self) -> int:
        """Forget all cached contents (e.g. after weights change). Returns blocks forgotten."""
        return self.pool.reset_prefix_cache()

    # -- reporting --------------------------------------------------------------------------
    def usage(self) -> KVUsage:
        return KVUsage(
            total_blocks=self.pool.num_blocks,
            used_blocks=self.pool.num_used_blocks,
            free_blocks=self.pool.num_free_blocks,
            cached_blocks=self.pool.num_cached_blocks,
            cached_free_blocks=self.pool.num_cached_free_blocks,
            block_size=self.block_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    def snapshot(self) -> PoolSnapshot:
        tables = {seq: TableSnapshot(tuple(t.block_ids), t.num_tokens) for seq, t in self._tables.items()}
        pool = self.pool
        refcounts = pool.refcounts()
        return PoolSnapshot(self.block_size, refcounts, frozenset(pool.prefix_cache.blocks()), tables)

    def num_table_blocks(self) -> int:
        """Blocks the tables reference, a shared block once per holder (the sum of refcounts)."""
        return sum(len(table.block_ids) for table in self._tables.values())

    def cached_prefix_blocks(
        self, token_ids: Sequence[int], use_cache: bool = True, cache_salt: str | None = None
    ) -> list[int]:
        """The cached blocks an allocation of ``token_ids`` would share (what admission reuses)."""
        return self._cached_prefix(token_ids, use_cache, cache_salt)

    def private_blocks(self, seq_id: SeqId, shared_soon: Collection[int] = ()) -> int:
        """Blocks only ``seq_id`` holds -- what freeing it gives back to the pool -- less those in
        ``shared_soon`` (about to be shared by an allocation)."""
        blocks = self.table(seq_id).block_ids
        if not shared_soon:
            return self.pool.count_private(blocks)
        return sum(1 for b in blocks if self.pool.refcount(b) == 1 and b not in shared_soon)

    def peak_blocks(self, admitted_tokens: int, final_tokens: int) -> int:
        """The most blocks one sequence holds at once: ``admitted_tokens`` allocated at admission,
        ``final_tokens`` at its end."""
        return blocks_for(max(admitted_tokens, final_tokens), self.block_size)

    def held_blocks(self, seq_id: SeqId) -> int:
        """Blocks ``seq_id``'s table holds (what it gives back, shared ones aside, when freed)."""
        return len(self.table(seq_id).block_ids)

    def is_in_use(self, block: int) -> bool:
        return self.pool.refcount(block) > 0

    def num_stored_tokens(self) -> int:
        """Tokens the tables hold, a shared token once per holder."""
        return sum(table.num_tokens for table in self._tables.values())

    def seq_ids(self) -> list[SeqId]:
        return list(self._tables)
