"""LoRA adapters' weights paged in the KV block pool (S-LoRA's unified paging).

An adapter takes ``pages`` block ids from the same :class:`~pagedkv.memory.block_pool.BlockPool`
as the KV cache, so memory goes to whichever the batch needs: KV blocks for long contexts, adapter
pages for many fine-tunes. A block id is, in every layer, two chunks of the KV cache's tensor
(its keys and its values); the adapter's layer-``l`` weights fill layer ``l``'s chunks of its pages
(:mod:`pagedkv.memory.adapter_layout` says where, :mod:`pagedkv.attention.adapter_slabs` moves the
bytes).

Every resident adapter is in one of two states:

* pinned -- used by running sequences (one pin per sequence); its pages are never taken back;
* idle -- no sequence uses it. Its weights stay in place, so the next request for it needs no
  reload, but its pages count as free: an allocation that finds no plain free or cached-free KV
  block evicts idle adapters, least recently used first (this object is the pool's
  :class:`~pagedkv.memory.block_pool.BlockReclaimer`).

Invariants: an adapter's pages are in use (refcount 1, held by this object alone), never in the
prefix cache and never shared with a block table; a pinned adapter is resident; the pages of idle
adapters are exactly :attr:`AdapterPages.reclaimable_blocks`.

The worker learns what to write from :meth:`AdapterPages.take_writes` (loads since the last call,
still resident) and must write them after the step's tier moves and block copies and before its
forward pass: a load may take cached-free blocks whose old contents a spill still reads.

With a second KV tier, :attr:`AdapterPages.on_evict` sees each idle adapter an allocation evicts
while its pages still hold its weights (written by an earlier step), so the tier copies them
out before the step reuses the blocks (:mod:`pagedkv.memory.tier.adapter_entries`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from pagedkv.memory.block_pool import BlockPool

AdapterId = Hashable
R = TypeVar("R")


class AdapterPagesError(MemoryError):
    """An adapter's pages do not fit in the pool even after evicting every idle adapter and
    cached-free KV block. Raised before anything changes."""

    def __init__(self, adapter_id: AdapterId, needed: int, free: int, total: int) -> None:
        self.adapter_id, self.needed, self.free, self.total = adapter_id, needed, free, total
        super().__init__(
            f"LoRA adapter {adapter_id!r} needs {needed} page(s) of the KV block pool but only {free} "
            f"of {total} can be freed (the rest hold running requests' KV blocks or pinned adapters)"
        )


@dataclass(frozen=True)
class ResidentAdapter:
    """One resident adapter: its pages (block ids) and how many running sequences pin it."""

    adapter_id: AdapterId
    block_ids: tuple[int, ...]
    pins: int


@dataclass(frozen=True)
class AdapterUsage:
    """Adapter pages in the pool, for the dashboard and metrics (counts since the start for
    ``loads`` and ``evictions``)."""

    resident_adapters: int
    pinned_adapters: int
    resident_pages: int
    pinned_pages: int
    loads: int
    evictions: int

    @property
    def idle_pages(self) -> int:
        """Pages an allocation may take back (they count as free blocks)."""
        return self.resident_pages - self.pinned_pages


class AdapterPages:
    """The resident adapters of one block pool, and the pool's reclaimer.

    One per :class:`~pagedkv.memory.manager.KVCacheManager` (``AdapterPages(manager.pool)``); the
    pool then counts idle adapters' pages among its free blocks and takes them back when it must.
    """

    def __init__(self, pool: BlockPool) -> None:
        if pool.reclaimer is not None:
            raise ValueError("this block pool already has a reclaimer; one AdapterPages per pool")
        self.pool = pool
        self._blocks: dict[AdapterId, list[int]] = {}
        self._pins: dict[AdapterId, int] = {}
        #: Resident adapters nobody pins, oldest use first: the eviction order.
        self._idle: OrderedDict[AdapterId, None] = OrderedDict()
        self._idle_pages = 0
        #: Loads the worker has not been told about yet (dropped if evicted first).
        self._unwritten: dict[AdapterId, list[int]] = {}
        self._evicted: list[AdapterId] = []
        self.num_loads = 0
        self.num_evictions = 0
        #: Called with an idle adapter's id and pages when an allocation evicts it and its pages
        #: hold its weights (a step wrote them); None: nothing keeps them.
        self.on_evict: Callable[[AdapterId, list[int]], None] | None = None
        pool.reclaimer = self

    # -- the pool's reclaimer ---------------------------------------------------------------
    @property
    def reclaimable_blocks(self) -> int:
        """Pages of idle adapters: what :meth:`reclaim` can give back."""
        return self._idle_pages

    def reclaim(self, n: int) -> int:
        """Evict idle adapters, least recently used first, until ``n`` pages are free (or none
        is idle); returns the pages freed."""
        freed = 0
        while freed < n and self._idle:
            adapter_id = next(iter(self._idle))
            freed += len(self._blocks[adapter_id])
            if self.on_evict is not None and adapter_id not in self._unwritten:
                self.on_evict(adapter_id, list(self._blocks[adapter_id]))
            self._evict(adapter_id)
        return freed

    def _evict(self, adapter_id: AdapterId) -> None:
        blocks = self._blocks.pop(adapter_id)
        del self._idle[adapter_id]
        self._idle_pages -= len(blocks)
        self._unwritten.pop(adapter_id, None)
        self._evicted.append(adapter_id)
        self.num_evictions += 1
        self.pool.free(blocks)

    # -- residency --------------------------------------------------------------------------
    def is_resident(self, adapter_id: AdapterId) -> bool:
        return adapter_id in self._blocks

    def block_ids(self, adapter_id: AdapterId) -> list[int]:
        """The pages of a resident adapter, in the order its weights fill them."""
        try:
            return list(self._blocks[adapter_id])
        except KeyError:
            raise KeyError(f"LoRA adapter {adapter_id!r} is not resident in the KV block pool") from None

    def pins(self, adapter_id: AdapterId) -> int:
        """How many running sequences use ``adapter_id`` (0 when idle or not resident)."""
        return self._pins.get(adapter_id, 0)

    def load(self, adapter_id: AdapterId, pages: int) -> list[int]:
        """Make ``adapter_id`` resident in ``pages`` blocks (idle until pinned); returns them.

        A resident adapter keeps its pages (and becomes the most recently used). A new one
        takes blocks as any allocation does -- plain free, then cached-free KV blocks, then
        idle adapters' pages -- or raises :class:`AdapterPagesError`, changing nothing.
        """
        if not isinstance(pages, int) or pages < 1:
            raise ValueError(f"LoRA adapter {adapter_id!r}: pages must be a positive integer, got {pages!r}")
        if adapter_id in self._blocks:
            held = len(self._blocks[adapter_id])
            if held != pages:
                raise ValueError(
                    f"LoRA adapter {adapter_id!r} is resident in {held} page(s), not {pages}: "
                    "unload it before loading other weights under its id"
                )
            if adapter_id in self._idle:
                self._idle.move_to_end(adapter_id)
            return list(self._blocks[adapter_id])
        free = self.pool.num_free_blocks
        if pages > free:
            raise AdapterPagesError(adapter_id, pages, free, self.pool.num_blocks)
        blocks = self.pool.allocate(pages)
        self._blocks[adapter_id] = blocks
        self._idle[adapter_id] = None
        self._idle_pages += pages
        self._unwritten[adapter_id] = blocks
        self.num_loads += 1
        return list(blocks)

    def unload(self, adapter_id: AdapterId) -> bool:
        """Give a resident, unpinned adapter's pages back now (an adapter unloaded by the user);
        False if it was not resident. A pinned adapter is refused: requests still use it."""
        if adapter_id not in self._blocks:
            return False
        if adapter_id in self._pins:
            raise ValueError(
                f"LoRA adapter {adapter_id!r} is used by {self._pins[adapter_id]} running sequence(s); "
                "it can be unloaded once they finish"
            )
        self._evict(adapter_id)
        return True

    # -- users ------------------------------------------------------------------------------
    def pin(self, adapter_id: AdapterId) -> None:
        """One more running sequence uses the resident ``adapter_id``: its pages stay."""
        if adapter_id not in self._blocks:
            raise KeyError(f"LoRA adapter {adapter_id!r} is not resident; load it before pinning it")
        pins = self._pins.get(adapter_id, 0)
        if pins == 0:
            del self._idle[adapter_id]
            self._idle_pages -= len(self._blocks[adapter_id])
        self._pins[adapter_id] = pins + 1

    def unpin(self, adapter_id: AdapterId) -> None:
        """A sequence using ``adapter_id`` finished or was preempted; the last one leaves it idle
        (resident, most recently used, its pages reclaimable)."""
        pins = self._pins.get(adapter_id, 0)
        if pins == 0:
            raise ValueError(f"LoRA adapter {adapter_id!r} is not pinned; unpin without a pin")
        if pins > 1:
            self._pins[adapter_id] = pins - 1
            return
        del self._pins[adapter_id]
        self._idle[adapter_id] = None
        self._idle_pages += len(self._blocks[adapter_id])

    def blocks_to_admit(self, adapter_id: AdapterId, pages: int) -> int:
        """Free blocks a sequence of ``adapter_id`` takes beyond its KV blocks: none when the
        adapter is pinned already, else its pages -- an idle resident adapter's pages count as
        free, so pinning it takes them as surely as loading it does."""
        return 0 if adapter_id in self._pins else pages

    def admit(self, adapter_id: AdapterId, pages: int, kv_blocks: int, allocate_kv: Callable[[], R]) -> R:
        """Pin ``adapter_id`` for a sequence being admitted, around the sequence's KV allocation
        ``allocate_kv`` (which takes ``kv_blocks`` free blocks); returns what it returns.

        A resident adapter is pinned first, so the KV allocation cannot reclaim it; a missing one
        is loaded after it, so the load cannot evict the cached prefix blocks the allocation
        shares. All or nothing: when the two do not fit together :class:`AdapterPagesError` is
        raised before anything changes, and a failed KV allocation leaves no pin behind.
        """
        needed = kv_blocks + self.blocks_to_admit(adapter_id, pages)
        if needed > self.pool.num_free_blocks:
            raise AdapterPagesError(adapter_id, needed, self.pool.num_free_blocks, self.pool.num_blocks)
        if adapter_id in self._blocks:
            self.pin(adapter_id)
            try:
                return allocate_kv()
            except BaseException:
                self.unpin(adapter_id)
                raise
        result = allocate_kv()
        self.load(adapter_id, pages)
        self.pin(adapter_id)
        return result

    # -- what the worker and the dashboard need ---------------------------------------------
    def take_writes(self) -> list[tuple[AdapterId, tuple[int, ...]]]:
        """Adapters loaded since the last call and still resident, with their pages: the worker
        writes their weights there before the step's forward pass."""
        writes = [(adapter_id, tuple(blocks)) for adapter_id, blocks in self._unwritten.items()]
        self._unwritten.clear()
        return writes

    def rewrite(self, adapter_id: AdapterId) -> None:
        """The worker failed to write a resident adapter's weights: the next :meth:`take_writes`
        names it again (nothing may read its pages before then)."""
        if adapter_id in self._blocks:
            self._unwritten[adapter_id] = self._blocks[adapter_id]

    def written(self) -> list[tuple[AdapterId, list[int]]]:
        """Resident adapters whose pages hold their weights (a step wrote them), with the pages."""
        return [(a, list(blocks)) for a, blocks in self._blocks.items() if a not in self._unwritten]

    def take_evicted(self) -> list[AdapterId]:
        """Adapters evicted or unloaded since the last call (their pages may now hold KV)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def resident(self) -> list[ResidentAdapter]:
        """Every resident adapter: pinned ones first, then idle ones, oldest use first."""
        pinned = [ResidentAdapter(a, tuple(self._blocks[a]), n) for a, n in self._pins.items()]
        return pinned + [ResidentAdapter(a, tuple(self._blocks[a]), 0) for a in self._idle]

    def usage(self) -> AdapterUsage:
        resident = sum(len(blocks) for blocks in self._blocks.values())
        return AdapterUsage(
            resident_adapters=len(self._blocks),
            pinned_adapters=len(self._pins),
            resident_pages=resident,
            pinned_pages=resident - self._idle_pages,
            loads=self.num_loads,
            evictions=self.num_evictions,
        )
