"""A KV cache manager with a second tier behind its pool: what leaves the pool is not lost.

Three decisions, taken while the scheduler allocates, come out as plain data
(:class:`~pagedkv.memory.tier.transfers.KVTransfers`, collected by :meth:`take_transfers`):

* **spill** -- when an allocation evicts a cached-free block from the pool's LRU, its contents
  are still intact (the step that reuses the id has not run), so they are copied to the tier
  under the block's chained hash, unless the tier already holds that hash;
* **load** -- an admission whose prefix misses the pool looks the rest of the chain up in the
  tier and loads the longest readable run into its new blocks instead of recomputing them;
* **swap or recompute** -- a preempted sequence's blocks past its cached prefix (which comes
  back through the prefix cache, pool or tier, like any prefix) are copied to swap slots when
  :class:`~pagedkv.memory.tier.transfers.SwapCostModel` says moving them is cheaper than
  recomputing them; readmission copies them back.

Ownership: a block hash lives in the pool (a cached block), in the tier (a readable block), or
both -- a full, immutable block whose two copies hold the same tokens under the same parent,
so either may be used. A spill in flight is not readable; a load in flight pins its tier slot.
The executor acknowledges moves with :meth:`complete`; inbound moves by the end of their step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedkv.memory.block_table import BlockTable, CopyPair, blocks_for
from pagedkv.memory.errors import PoolExhaustedError
from pagedkv.memory.manager import KVCacheManager, Preemption, SeqId
from pagedkv.memory.prefix_cache import RemovedBlock, root_hash, root_of
from pagedkv.memory.tier.slots import KVTier, SwapKey, TierBlock, TierEvent
from pagedkv.memory.tier.transfers import BlockLoad, BlockSpill, KVTransfers, SwapCostModel, TransferReport

#: ``preemption_mode`` values (vLLM's): None lets the cost model choose per request.
PREEMPTION_MODES = (None, "swap", "recompute")


@dataclass(frozen=True)
class TierUsage:
    """The second tier now, in blocks."""

    medium: str
    capacity_blocks: int
    cached_blocks: int
    swap_blocks: int
    free_blocks: int


@dataclass(frozen=True)
class _SwapRecord:
    #: blocks before ``start`` come back through the prefix cache, the others from swap slots
    start: int
    keys: list[SwapKey]
    num_computed: int


@dataclass(frozen=True)
class _Inbound:
    """An inbound move in flight: a load of ``what`` (a hash) or a swap-in (a swap key)."""

    swap: bool
    what: object
    seq_id: SeqId | None  # None: a load of an adapter's page
    index: int


class TieredKVCacheManager(KVCacheManager):
    """:class:`KVCacheManager` plus ``tier``; ``bytes_per_block`` sizes the swap decision."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        tier: KVTier,
        bytes_per_block: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        cost_model: SwapCostModel | None = None,
        preemption_mode: str | None = None,
    ) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
        super().__init__(num_blocks, block_size, enable_prefix_caching, watermark, hash_blocks=True)
        self.tier = tier
        self.bytes_per_block = bytes_per_block
        self.cost_model = cost_model or SwapCostModel()
        self.preemption_mode = preemption_mode
        self.pool.on_evict = self._spill
        self._planned = KVTransfers()
        #: outbound moves in flight, by tier slot: ("spill", hash) or ("swap", key)
        self._storing: dict[int, tuple[str, object]] = {}
        #: inbound moves in flight, by tier slot (two loads may read one slot)
        self._loading: dict[int, list[_Inbound]] = {}
        self._swapped: dict[SeqId, _SwapRecord] = {}
        self._load_failures: dict[SeqId, int] = {}
        #: hashes of loads into no sequence's blocks (adapter pages) that failed their check
        self._page_load_failures: list[int] = []
        #: copy-on-write copies handed out since the last plan, destination -> source: a
        #: swap-out of a destination reads the source, as the copy runs after swap-outs
        self._copy_source: dict[int, int] = {}
        #: vLLM's external prefix cache counters: prompt tokens looked up in / loaded from the tier
        self.tier_query_tokens = 0
        self.tier_hit_tokens = 0
        self.blocks_spilled = 0
        self.blocks_loaded = 0
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0
        self.num_swapped_preemptions = 0
        self.num_recomputed_preemptions = 0
        #: swapped sequences whose cached prefix was gone at readmission: they recompute
        self.swap_fallbacks = 0

    # -- admission --------------------------------------------------------------------------
    def _allocate_prompt(
        self, seq_id: SeqId, token_ids: Sequence[int], reserve: int, use_cache: bool, salt: str | None
    ) -> int:
        """:meth:`KVCacheManager.allocate`'s pool hits, then the prompt's next blocks from the tier
        (loads), or, for a swapped-out sequence, its blocks back from swap slots. Returns the
        tokens the sequence need not compute (pool hits, loads, swap-ins). A tier block is found
        only under the same ``cache_salt``: its hash chain starts at the salt's root."""
        if seq_id in self._swapped:
            return self._swap_in(seq_id, token_ids, reserve, salt)
        hits = self._cached_prefix(token_ids, use_cache, salt)
        tier_hits = self._tier_prefix(token_ids, hits, use_cache, None, salt)
        self._admit(seq_id, token_ids, hits, tier_hits, reserve, salt)
        cached = (len(hits) + len(tier_hits)) * self.block_size
        if self.enable_prefix_caching and use_cache:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += len(hits) * self.block_size
            self.tier_query_tokens += len(token_ids)
            self.tier_hit_tokens += len(tier_hits) * self.block_size
        return cached

    def swap_ready(self, seq_id: SeqId) -> bool:
        """False while a swapped-out sequence's blocks are still being written to the tier: it
        cannot be readmitted yet. True for any other sequence."""
        record = self._swapped.get(seq_id)
        return record is None or not self.tier.swap_storing(record.keys)

    def is_swapped(self, seq_id: SeqId) -> bool:
        return seq_id in self._swapped

    def _tier_prefix(
        self,
        token_ids: Sequence[int],
        hits: list[int],
        use_cache: bool,
        max_blocks: int | None,
        cache_salt: str | None,
    ) -> list[TierBlock]:
        """The readable tier blocks continuing the pool's ``hits`` (never the last token)."""
        if not (self.enable_prefix_caching and use_cache):
            return []
        cache = self.pool.prefix_cache
        self.tier.touch(cache.hash_of(b) for b in hits)
        stop = (len(token_ids) - 1) // self.block_size
        if max_blocks is not None:
            stop = min(stop, max_blocks)
        parent = cache.hash_of(hits[-1]) if hits else root_hash(root_of(cache_salt))
        return self.tier.match(token_ids, self.block_size, len(hits), stop, parent)

    def _admit(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        hits: list[int],
        tier_hits: list[TierBlock],
        reserve_tokens: int,
        cache_salt: str | None,
    ) -> BlockTable:
        # Pinned before allocating: the evictions the allocation causes spill into the tier,
        # and must not take the slots these loads read.
        self.tier.pin(tier_hits)
        try:
            table = self._allocate_with_hits(seq_id, token_ids, hits, reserve_tokens, cache_salt)
        except PoolExhaustedError:
            for entry in tier_hits:
                self.tier.unpin(entry.block_hash, entry.slot)
            raise
        for index, entry in enumerate(tier_hits, start=len(hits)):
            block = table.block_ids[index]
            self._planned.loads.append(BlockLoad(entry.slot, block, entry.block_hash))
            self._loading.setdefault(entry.slot, []).append(_Inbound(False, entry.block_hash, seq_id, index))
            self.blocks_loaded += 1
        return table

    def _swap_in(
        self, seq_id: SeqId, token_ids: Sequence[int], reserve_tokens: int, cache_salt: str | None
    ) -> int:
        record = self._swapped[seq_id]
        if self.tier.swap_storing(record.keys):
            raise ValueError(f"sequence {seq_id!r} is still being swapped out; wait for swap_ready()")
        hits = self._cached_prefix(token_ids, True, cache_salt)
        tier_hits = (
            self._tier_prefix(token_ids, hits, True, record.start, cache_salt)
            if len(hits) < record.start
            else []
        )
        covered = len(hits) + len(tier_hits)
        if covered < record.start or self.tier.swap_failed(record.keys):
            # The cached prefix the swap relied on is gone (or a write failed): recompute.
            del self._swapped[seq_id]
            self.tier.release_swap(record.keys)
            self.swap_fallbacks += 1
            return self.allocate(seq_id, token_ids, reserve_tokens, cache_salt=cache_salt)
        table = self._admit(seq_id, token_ids, hits, tier_hits, reserve_tokens, cache_salt)
        del self._swapped[seq_id]
        for index, key in enumerate(record.keys, start=record.start):
            if index < covered:  # the prefix cache had this block too
                self.tier.release_swap([key])
                continue
            slot = self.tier.swap_slot(key)
            self._planned.swap_ins.append((slot, table.block_ids[index]))
            self._loading.setdefault(slot, []).append(_Inbound(True, key, seq_id, index))
            self.blocks_swapped_in += 1
        return max(record.num_computed, covered * self.block_size)

    # -- eviction and preemption ------------------------------------------------------------
    def _spill(self, evicted: list[RemovedBlock]) -> None:
        """The pool evicts these cached-free blocks: copy each into the tier (if new there)."""
        for entry in evicted:
            assert entry.block_hash is not None  # the pool hashes its blocks
            self.plan_spill(entry.block_id, entry.block_hash, entry.parent_hash, entry.key[1], entry.root)

    def plan_spill(
        self,
        block_id: int,
        digest: int,
        parent_hash: int | None,
        token_ids: tuple[int, ...],
        root: int | None = None,
    ) -> bool:
        """Copy pool block ``block_id``, whose contents are about to be reused, into the tier as
        ``digest``; False when the tier holds it already (now more recently used) or has no
        slot. The copy reads the block before anything of this step writes it."""
        slot = self.tier.store(digest, parent_hash, token_ids, root)
        if slot is None:
            return False
        self._planned.spills.append(BlockSpill(block_id, slot, digest, parent_hash, token_ids))
        self._storing[slot] = ("spill", digest)
        self.blocks_spilled += 1
        return True

    def plan_loads(self, entries: list[TierBlock], block_ids: Sequence[int]) -> None:
        """Copy readable tier ``entries`` into pool blocks ``block_ids`` (owned by no sequence:
        an adapter's pages) before this step's forward pass. A load that fails its check is
        reported by :meth:`take_page_load_failures`, not as a sequence's."""
        self.tier.pin(entries)
        for index, (entry, block) in enumerate(zip(entries, block_ids, strict=True)):
            self._planned.loads.append(BlockLoad(entry.slot, block, entry.block_hash))
            self._loading.setdefault(entry.slot, []).append(_Inbound(False, entry.block_hash, None, index))
            self.blocks_loaded += 1

    def preempt(
        self, seq_id: SeqId, token_ids: Sequence[int], num_computed: int, allow_swap: bool = True
    ) -> Preemption:
        """Take ``seq_id``'s blocks back, swapping out the computed blocks past its cached prefix
        when ``preemption_mode`` (or, unset, the cost model) says so and the tier has room."""
        table = self.table(seq_id)
        end = blocks_for(min(num_computed, table.num_tokens), self.block_size)
        start = min(table.num_cached_blocks, end) if self.enable_prefix_caching else 0
        if start and table.block_ids[start - 1] not in self.pool.prefix_cache:
            start = 0  # a reset forgot the cached prefix: it cannot come back by hash
        to_move = end - start
        recompute_tokens = num_computed - start * self.block_size
        wanted = {
            None: self.cost_model.prefers_swap(to_move * self.bytes_per_block, recompute_tokens),
            "swap": True,
            "recompute": False,
        }[self.preemption_mode]
        keys = [(seq_id, index) for index in range(start, end)]
        slots = self.tier.reserve_swap(keys) if allow_swap and to_move and wanted else None
        if slots is not None:
            for key, slot in zip(keys, slots, strict=True):
                block = table.block_ids[key[1]]
                self._planned.swap_outs.append((self._copy_source.get(block, block), slot))
                self._storing[slot] = ("swap", key)
            self._swapped[seq_id] = _SwapRecord(start, keys, num_computed)
            self.blocks_swapped_out += to_move
            self.num_swapped_preemptions += 1
        else:
            self.num_recomputed_preemptions += 1
        super().free(seq_id)
        if slots is None:
            return Preemption(False, 0, 0)
        return Preemption(True, to_move, num_computed)

    # -- copy-on-write, remembered for swap-outs ------------------------------------------
    def append_slots(self, seq_id: SeqId, n: int = 1) -> list[CopyPair]:
        return self._remember(super().append_slots(seq_id, n))

    def try_append(self, seq_id: SeqId, n: int = 1) -> list[CopyPair] | None:
        copies = super().try_append(seq_id, n)
        return None if copies is None else self._remember(copies)

    def fork(self, parent_id: SeqId, child_id: SeqId, share: bool = True) -> list[CopyPair]:
        return self._remember(super().fork(parent_id, child_id, share))

    def _remember(self, copies: list[CopyPair]) -> list[CopyPair]:
        for src, dst in copies:
            self._copy_source[dst] = self._copy_source.get(src, src)
        return copies

    def free(self, seq_id: SeqId) -> None:
        """Release ``seq_id``'s blocks, and its swap slots if it was swapped out. Idempotent."""
        super().free(seq_id)
        record = self._swapped.pop(seq_id, None)
        if record is not None:
            self.tier.release_swap(record.keys)

    def spill_cached(self) -> int:
        """Plan a copy of every pool-cached block the tier lacks into it, least recently used
        first (a disk tier then keeps them across a restart); returns how many were planned."""
        pool = self.pool
        cache = pool.prefix_cache
        held = [block for block in cache.blocks() if pool.refcount(block) > 0]
        planned = self.blocks_spilled
        self._spill([cache.entry(block) for block in pool.cached_free_block_ids() + held])
        return self.blocks_spilled - planned

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, in the pool and in the tier (swap slots stay)."""
        return super().reset_prefix_cache() + self.tier.clear()

    # -- the executor's side ----------------------------------------------------------------
    def take_transfers(self) -> KVTransfers:
        """The moves planned since the last call, for this step's plan."""
        planned, self._planned = self._planned, KVTransfers()
        planned.forgotten.extend(self.tier.take_forgotten())
        self._copy_source.clear()
        return planned

    def complete(self, report: TransferReport) -> None:
        """The executor finished these moves (see :class:`TransferReport`)."""
        for slot, ok in report.stored:
            kind, what = self._storing.pop(slot)
            if kind == "spill":
                self.tier.stored(what, slot, ok)  # type: ignore[arg-type]
            else:
                self.tier.swap_stored(what, ok)  # type: ignore[arg-type]
        for slot, ok in report.loaded:
            moves = self._loading[slot]
            move = moves.pop(0)
            if not moves:
                del self._loading[slot]
            if move.swap:
                self.tier.release_swap([move.what])  # type: ignore[list-item]
            else:
                self.tier.unpin(move.what, slot, ok)  # type: ignore[arg-type]
            if not ok and move.seq_id is None:
                self._page_load_failures.append(move.what)  # type: ignore[arg-type]
            elif not ok:
                valid = move.index * self.block_size
                self._load_failures[move.seq_id] = min(valid, self._load_failures.get(move.seq_id, valid))

    def take_load_failures(self) -> dict[SeqId, int]:
        """Sequences some of whose loads failed, and how many of their tokens are still valid:
        their computed count must fall back to it before their blocks are cached."""
        failures, self._load_failures = self._load_failures, {}
        return failures

    def take_page_load_failures(self) -> list[int]:
        """The hashes whose :meth:`plan_loads` failed their check since the last call (the tier
        has forgotten them)."""
        failures, self._page_load_failures = self._page_load_failures, []
        return failures

    def transfers_in_flight(self) -> int:
        return len(self._storing) + sum(len(moves) for moves in self._loading.values())

    def restore(self, blocks: Iterable[tuple[int, int | None, Sequence[int]]]) -> dict[int, int]:
        """Index the tier blocks a restart found (see :meth:`KVTier.restore`)."""
        return self.tier.restore(blocks)

    # -- reporting --------------------------------------------------------------------------
    def take_tier_events(self) -> list[TierEvent]:
        return self.tier.take_events()

    def tier_usage(self) -> TierUsage:
        t = self.tier
        return TierUsage(t.medium, t.capacity, t.num_blocks, t.num_swap_slots, t.num_free_slots)
