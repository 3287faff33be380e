"""The physical KV blocks: who holds each one, which are free, which are cached.

Three disjoint states cover every block at all times:

* in use -- refcount > 0, held by one or more block tables (or by the adapter pages of
  :mod:`pagedkv.memory.adapter_pages`, which hold each of their blocks once);
* free -- refcount 0 and holding nothing worth keeping (a stack: O(1) pop and push);
* cached-free -- refcount 0 but its contents are registered in the prefix cache, so a later
  request with the same prefix can take it back without recomputing. These sit in an LRU queue
  (an ``OrderedDict``: O(1) push, pop and removal by id) and are evicted, oldest first, only when
  the plain free stack is empty.

A :class:`BlockReclaimer` (the pool's ``reclaimer``) may hold in-use blocks it can give back on
demand -- an idle LoRA adapter's pages. They count as free, like cached-free blocks, and are
taken back last: an allocation evicts cached-free KV blocks first, then asks the reclaimer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from pagedkv.memory.errors import PoolExhaustedError
from pagedkv.memory.prefix_cache import ROOT, PrefixCache, RemovedBlock
from pagedkv.memory.tier.slots import TierEvent


class KVCacheListener(Protocol):
    """Told when the prefix cache gains or loses content, e.g. to publish KV cache events.

    Called on the thread that changes the pool (the engine's), in the order things happen: a
    block is always stored after its parent and removed before its id is handed out again, so a
    listener can key what it knows by block id. Keep the calls cheap (queue, don't send).
    """

    def block_stored(self, block_id: int, parent: int, token_ids: Sequence[int]) -> None:
        """A full block's contents became reusable (``parent`` is a root for a first block:
        ``ROOT``, or a salted request's root hash)."""

    def blocks_removed(self, block_ids: Sequence[int]) -> None:
        """These cached blocks were evicted or forgotten: their contents are gone."""

    def all_blocks_cleared(self) -> None:
        """The whole prefix cache was reset."""

    def tier_changed(self, events: Sequence[TierEvent]) -> None:
        """Blocks became readable in a second KV tier, or left it (a tiered engine only; after
        the step that moved them)."""


class BlockReclaimer(Protocol):
    """Holds in-use blocks that an allocation may take back (idle adapter pages)."""

    @property
    def reclaimable_blocks(self) -> int:
        """Blocks :meth:`reclaim` could free right now."""

    def reclaim(self, n: int) -> int:
        """Free at least ``n`` blocks to the pool's free stack (fewer only when
        :attr:`reclaimable_blocks` is smaller); returns how many it freed."""


class BlockPool:
    """A fixed number of physical blocks of ``block_size`` token slots each.

    ``hash_blocks`` names every cached block by its chained content hash as well (what a second
    KV tier needs; see :class:`~pagedkv.memory.prefix_cache.PrefixCache`).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, hash_blocks: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"BlockPool.num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"BlockPool.block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        #: Blocks with more than one holder: while there are none, every held block is private.
        self._num_shared = 0
        # Reversed so that a fresh pool hands out block 0, 1, 2, ... (easier to read in plots).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.prefix_cache = PrefixCache(hash_blocks)
        self.num_evictions = 0
        #: Told about every change to the cached contents (None: nobody listens).
        self.listener: KVCacheListener | None = None
        #: Told, during :meth:`allocate`, which cached-free blocks an eviction takes, before
        #: their ids are handed out: their contents are intact until the step that reuses them
        #: writes there, so they can still be copied to a second tier (None: nobody).
        self.on_evict: Callable[[list[RemovedBlock]], None] | None = None
        #: Gives back in-use blocks when the free and cached-free ones run short (None: nobody).
        self.reclaimer: BlockReclaimer | None = None

    # -- counts -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take right now: plain free, evictable cached ones, and those
        the reclaimer can give back."""
        free = len(self._free) + len(self._evictable)
        return free if self.reclaimer is None else free + self.reclaimer.reclaimable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose contents are registered in the prefix cache, held or not."""
        return len(self.prefix_cache)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def refcounts(self) -> tuple[int, ...]:
        """Every block's refcount, by block id (one copy, for snapshots)."""
        return tuple(self._refcount)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one block table."""
        return self._num_shared

    def count_private(self, block_ids: Sequence[int]) -> int:
        """How many of the held blocks ``block_ids`` have exactly one holder: all of them while
        no block is shared (no fork, no prefix hit), else a C-speed count. The scheduler asks
        this for every running sequence at every admission check."""
        if not self._num_shared:
            return len(block_ids)
        return list(map(self._refcount.__getitem__, block_ids)).count(1)

    def free_block_ids(self) -> list[int]:
        """Plain free blocks (for invariant checks and plots; O(free))."""
        return list(self._free)

    def cached_free_block_ids(self) -> list[int]:
        return list(self._evictable)

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks with refcount 1, all or nothing.

        Plain free blocks go first; only then are cached-free blocks evicted, least recently
        used first; only then does the reclaimer give blocks back.
        """
        if n == 1 and self._free:  # a decode's new block: no eviction, no loop
            block = self._free.pop()
            self._refcount[block] = 1
            return [block]
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise PoolExhaustedError(n, self.num_free_blocks, self.num_blocks)
        short = n - len(self._free) - len(self._evictable)
        if short > 0 and self.reclaimer is not None:
            self.reclaimer.reclaim(short)
        blocks = []
        for _ in range(n):
            if not self._free:
                victim, _ = self._evictable.popitem(last=False)
                self._forget(victim)
                self.num_evictions += 1
            block = self._free.pop()
            self._refcount[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, block_id: int) -> None:
        """Add a holder. A cached-free block comes back into use; a plain free one cannot."""
        if self._refcount[block_id] == 0:
            if block_id not in self._evictable:
                raise ValueError(f"block {block_id} is free and holds no cached data; it cannot be shared")
            del self._evictable[block_id]
        self._refcount[block_id] += 1
        if self._refcount[block_id] == 2:
            self._num_shared += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; those reaching zero become free or cached-free.

        Freed cached blocks join the LRU queue at the young end, in the order given: callers
        pass a table's blocks tail first, so a sequence's last blocks are evicted before the
        prefix blocks that other requests are more likely to share.
        """
        for block in block_ids:
            count = self._refcount[block]
            if count <= 0:
                raise ValueError(f"double free of block {block}: its refcount is already 0")
            self._refcount[block] = count - 1
            if count == 2:
                self._num_shared -= 1
            if count == 1:
                if block in self.prefix_cache:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # -- prefix caching ---------------------------------------------------------------------
    def cache_block(self, block_id: int, parent: int, token_ids: Sequence[int]) -> bool:
        """Register a full, computed, held block's contents. False if already cached elsewhere."""
        if self._refcount[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use; only held blocks can be cached")
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(token_ids)} of {self.block_size} tokens")
        stored = self.prefix_cache.insert(block_id, parent, token_ids)
        if stored and self.listener is not None:
            self.listener.block_stored(block_id, parent, token_ids)
        return stored

    def match_prefix(self, token_ids: Sequence[int], max_blocks: int, root: int = ROOT) -> list[int]:
        """Cached blocks under ``root`` covering the longest prefix of ``token_ids`` (no side
        effects)."""
        return self.prefix_cache.match(token_ids, self.block_size, max_blocks, root)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Mark cached-free blocks as recently used (moves them to the young end of the LRU)."""
        for block in block_ids:
            if block in self._evictable:
                self._evictable.move_to_end(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; cached-free blocks become plain free. Returns how many."""
        forgotten = 0
        for block in list(self.prefix_cache.blocks()):
            if block in self.prefix_cache:
                forgotten += len(self._forget(block, notify=False))
        if forgotten and self.listener is not None:
            self.listener.all_blocks_cleared()
        return forgotten

    def _forget(self, block_id: int, notify: bool = True) -> list[int]:
        """Drop ``block_id`` and its cached descendants from the cache; free the unheld ones.
        ``notify``: an eviction (tell the listener and ``on_evict``), not a reset."""
        if notify and self.on_evict is not None:
            removed = self.prefix_cache.remove_entries(block_id)
            self.on_evict([entry for entry in removed if self._refcount[entry.block_id] == 0])
            forgotten = [entry.block_id for entry in removed]
        else:
            forgotten = self.prefix_cache.remove(block_id)
        if forgotten and notify and self.listener is not None:
            self.listener.blocks_removed(forgotten)
        for block in forgotten:
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)
            elif block == block_id and self._refcount[block] == 0:
                self._free.append(block)
        return forgotten
