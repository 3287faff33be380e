"""The second KV tier's bookkeeping: which block contents it holds, in which slot, in what state.

The tier (host RAM or disk, behind the device pool) has ``capacity`` slots of one block each.
A slot holds one of two kinds of contents:

* a **hashed block** -- a full, immutable block named by its chained content hash
  (:mod:`pagedkv.memory.block_hash`), spilled when the pool evicted it and loaded back on a
  prefix hit; it also keeps its parent hash and token ids, compared on every hit, so a hash
  collision can never hand out the wrong keys and values;
* a **swap slot** -- one block of a preempted sequence, keyed by (sequence id, block index)
  because its last block is partial and never hashed; it stays until swapped in or dropped.

A hashed block may also be one page of an idle LoRA adapter evicted from the pool
(:mod:`pagedkv.memory.tier.adapter_entries`): its parent hash is :data:`ADAPTER_PAGE_PARENT`,
which no KV block has, so a prompt never matches it; it is stored, evicted and counted as any
block is, but announces no KV event (it holds weights, not keys and values).

A hashed block is **storing** from the moment a spill is planned until the executor reports the
copy complete (a disk write may outlive the step that planned it); only then is it readable.
A readable block with loads in flight is **pinned**: never evicted, since a load still reads
its slot. Readable, unpinned blocks sit in an LRU queue and are evicted oldest first when a
slot is needed. A block forgotten while busy (storing or pinned, e.g. by :meth:`KVTier.clear`)
is *dropped*: unreadable at once, its slot free only when the last transfer using it ends.

Invariant, checked by the tests: every slot is free, or held by exactly one hashed block or
one swap key. Nothing here touches bytes: :mod:`pagedkv.memory.tier.host` moves them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from pagedkv.memory.block_hash import block_hash
from pagedkv.memory.prefix_cache import root_of_hash

#: vLLM's KV event medium of the device pool, and those of the second tier (host RAM, disk).
POOL_MEDIUM = "GPU"
TIER_MEDIUMS = ("CPU", "DISK")

#: The parent hash of an adapter page's entry: -1 is neither a block's hash (those are
#: non-negative) nor a salted root (those are -2 or less) nor None (an unsalted first block).
ADAPTER_PAGE_PARENT = -1

#: (sequence id, index of the block in its table)
SwapKey = tuple[Hashable, int]


@dataclass
class TierBlock:
    """A hashed block's entry. ``storing``: the copy in is not complete, so it is not readable;
    ``pins``: loads in flight reading its slot; ``dropped``: forgotten while busy; ``root``: the
    prefix cache's root of its chain (a salted or LoRA adapter's root names its tenant), None
    when unknown."""

    slot: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    storing: bool = True
    pins: int = 0
    dropped: bool = False
    root: int | None = None

    @property
    def announced(self) -> bool:
        """KV events publish it: a KV block, not an adapter's page."""
        return self.parent_hash != ADAPTER_PAGE_PARENT

    @property
    def readable(self) -> bool:
        return not (self.storing or self.dropped)

    @property
    def busy(self) -> bool:
        return self.storing or self.pins > 0


@dataclass
class SwapSlot:
    """A swap-out's slot. ``storing``: the copy in is not complete; ``failed``: it never will be
    (the slot's contents are unusable); ``released``: nobody needs it once the copy ends."""

    slot: int
    storing: bool = True
    failed: bool = False
    released: bool = False


@dataclass(frozen=True)
class TierEvent:
    """A change a KV-event listener publishes: a block became readable in the tier (``removed``
    False, with its parent hash, tokens and its chain's root, by which the listener names the
    LoRA adapter whose request made it) or blocks left it."""

    removed: bool
    block_hashes: tuple[int, ...]
    medium: str
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    root: int | None = None


class KVTier:
    """The index of one second tier: ``capacity`` block slots in ``medium`` ("CPU" or "DISK")."""

    def __init__(self, capacity: int, medium: str = "CPU") -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"KVTier.capacity must be a positive number of blocks, got {capacity!r}")
        if medium not in TIER_MEDIUMS:
            raise ValueError(f"KVTier.medium must be one of {TIER_MEDIUMS}, got {medium!r}")
        self.capacity = capacity
        self.medium = medium
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._blocks: dict[int, TierBlock] = {}
        #: readable, unpinned hashed blocks, least recently used first
        self._lru: OrderedDict[int, None] = OrderedDict()
        #: dropped blocks still busy, by slot (their hash may already name a newer entry)
        self._dropped: dict[int, TierBlock] = {}
        self._swaps: dict[SwapKey, SwapSlot] = {}
        self._events: list[TierEvent] = []
        #: hashes that left the index since the last take: a disk tier deletes their files
        self._forgotten: list[int] = []
        self.num_evictions = 0

    # -- counts -----------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_obtainable_slots(self) -> int:
        """Slots a store or swap could take now: free ones plus evictable blocks."""
        return len(self._free) + len(self._lru)

    @property
    def num_blocks(self) -> int:
        """Hashed blocks held (storing or readable)."""
        return len(self._blocks)

    @property
    def num_swap_slots(self) -> int:
        return len(self._swaps)

    def __contains__(self, digest: int) -> bool:
        return digest in self._blocks

    def get(self, digest: int) -> TierBlock | None:
        return self._blocks.get(digest)

    def slot_owners(self) -> dict[int, tuple[str, object]]:
        """Every held slot and what holds it: ("block", hash), ("swap", key), or, waiting for
        their transfers to end, ("dropped", hash) and ("released", key)."""
        owners: dict[int, tuple[str, object]] = {}
        owners.update((b.slot, ("block", b.block_hash)) for b in self._blocks.values())
        owners.update((b.slot, ("dropped", b.block_hash)) for b in self._dropped.values())
        owners.update((s.slot, ("released" if s.released else "swap", key)) for key, s in self._swaps.items())
        return owners

    def free_slots(self) -> list[int]:
        return list(self._free)

    def readable_blocks(self) -> list[TierBlock]:
        return [b for b in self._blocks.values() if b.readable]

    # -- hashed blocks ----------------------------------------------------------------------
    def match(
        self, token_ids: Sequence[int], block_size: int, start: int, stop: int, parent_hash: int | None
    ) -> list[TierBlock]:
        """The readable blocks covering blocks ``start .. stop - 1`` of ``token_ids`` in a row,
        chained under ``parent_hash`` (the hash of block ``start - 1``); parent hash and tokens
        are compared, not only the hash. Hashes only as far as the chain goes."""
        chain: list[TierBlock] = []
        for i in range(start, stop):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            entry = self._blocks.get(block_hash(parent_hash, tokens))
            if entry is None or not entry.readable or entry.parent_hash != parent_hash:
                break
            if entry.token_ids != tokens:
                break
            chain.append(entry)
            parent_hash = entry.block_hash
        return chain

    def store(
        self, digest: int, parent_hash: int | None, token_ids: Sequence[int], root: int | None = None
    ) -> int | None:
        """Take a slot for a spill of block ``digest`` (of the chain under ``root``): its slot,
        or None to skip (already here, or every slot busy). The block is storing until
        :meth:`stored`."""
        if digest in self._blocks:
            self.touch([digest])
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._blocks[digest] = TierBlock(slot, digest, parent_hash, tuple(token_ids), root=root)
        return slot

    def stored(self, digest: int, slot: int, ok: bool = True) -> None:
        """The spill into ``slot`` completed (``ok``) or failed: readable now, or forgotten."""
        entry = self._busy_entry(digest, slot)
        if not entry.storing:
            raise ValueError(f"block {digest:#x} in slot {slot} is not being stored")
        entry.storing = False
        if entry.dropped or not ok:
            self._release(entry, announce=False)
            return
        self._lru[digest] = None
        self._announce_stored(entry)

    def pin(self, entries: Iterable[TierBlock]) -> None:
        """A load of each entry is planned: keep its slot until :meth:`unpin`."""
        for entry in entries:
            if not entry.readable:
                raise ValueError(f"block {entry.block_hash:#x} is not readable; it cannot be loaded")
            entry.pins += 1
            self._lru.pop(entry.block_hash, None)

    def unpin(self, digest: int, slot: int, ok: bool = True) -> None:
        """A load ended; ``ok`` False: the slot's contents proved unreadable, forget the block."""
        entry = self._busy_entry(digest, slot)
        if entry.pins <= 0:
            raise ValueError(f"block {digest:#x} in slot {slot} has no load in flight")
        entry.pins -= 1
        if not ok and not entry.dropped:
            self._drop(entry)
        if entry.pins == 0:
            if entry.dropped:
                self._release(entry, announce=False)
            else:
                self._lru[digest] = None  # the young end: it was just used

    def touch(self, digests: Iterable[int]) -> None:
        """Mark readable blocks as recently used."""
        for digest in digests:
            if digest in self._lru:
                self._lru.move_to_end(digest)

    def restore(self, blocks: Iterable[tuple[int, int | None, Sequence[int]]]) -> dict[int, int]:
        """Index readable blocks found at start-up (the disk tier's files), oldest first, as
        (hash, parent hash, token ids); returns the slot given to each hash indexed. Blocks past
        the capacity, or whose hash does not match their parent and tokens, are left out."""
        slots: dict[int, int] = {}
        for digest, parent_hash, token_ids in blocks:
            if digest in self._blocks or not self._free or block_hash(parent_hash, token_ids) != digest:
                continue
            entry = TierBlock(self._free.pop(), digest, parent_hash, tuple(token_ids), storing=False)
            self._blocks[digest] = entry
            self._lru[digest] = None
            slots[digest] = entry.slot
        for digest in slots:
            entry = self._blocks[digest]
            entry.root = self._restored_root(entry)
            self._announce_stored(entry)
        return slots

    def _restored_root(self, entry: TierBlock) -> int | None:
        """A restored block's chain root: a first block's from its parent hash, else its
        parent's in the tier (None when a parent is missing)."""
        chain = []
        while entry.root is None and entry.parent_hash is not None and entry.parent_hash >= 0:
            chain.append(entry)
            if (entry := self._blocks.get(entry.parent_hash)) is None:
                return None
        root = entry.root if entry.root is not None else root_of_hash(entry.parent_hash)
        for child in chain:
            child.root = root
        return root

    def forget(self, digests: Iterable[int]) -> None:
        """Forget these hashed blocks (absent ones are skipped); busy ones are dropped and free
        their slots when their transfers end."""
        for digest in digests:
            entry = self._blocks.get(digest)
            if entry is None:
                continue
            if entry.busy:
                self._drop(entry)
            else:
                self._release(entry, announce=True)

    def clear(self) -> int:
        """Forget every KV block (their contents are no longer valid); busy ones are dropped
        and free their slots when their transfers end. Swap slots and adapters' pages stay."""
        forgotten = [digest for digest, entry in self._blocks.items() if entry.announced]
        self.forget(forgotten)
        return len(forgotten)

    # -- swap slots -------------------------------------------------------------------------
    def reserve_swap(self, keys: Sequence[SwapKey]) -> list[int] | None:
        """Slots for a swap-out of ``keys``, all or none (evicting readable blocks as needed)."""
        if len(keys) > self.num_obtainable_slots:
            return None
        for key in keys:
            if key in self._swaps:
                raise ValueError(f"swap slot {key!r} is already taken")
        slots = []
        for key in keys:
            slot = self._take_slot()
            assert slot is not None  # counted above
            self._swaps[key] = SwapSlot(slot)
            slots.append(slot)
        return slots

    def swap_stored(self, key: SwapKey, ok: bool = True) -> None:
        """The swap-out into ``key``'s slot completed (or failed: its contents are unusable)."""
        swap = self._swaps[key]
        if not swap.storing:
            raise ValueError(f"swap slot {key!r} is not being stored")
        swap.storing = False
        swap.failed = not ok
        if swap.released:
            del self._swaps[key]
            self._free.append(swap.slot)

    def swap_storing(self, keys: Iterable[SwapKey]) -> bool:
        """Some slot of ``keys`` is still being written."""
        return any(self._swaps[key].storing for key in keys)

    def swap_failed(self, keys: Iterable[SwapKey]) -> bool:
        """Some slot of ``keys`` failed its write: the swap cannot be used."""
        return any(self._swaps[key].failed for key in keys)

    def swap_slot(self, key: SwapKey) -> int:
        return self._swaps[key].slot

    def release_swap(self, keys: Iterable[SwapKey]) -> None:
        """The swap slots of ``keys`` are done with (swapped in, or their sequence is gone);
        a slot still being written is freed when its write ends."""
        for key in keys:
            swap = self._swaps[key]
            if swap.storing:
                swap.released = True
            else:
                del self._swaps[key]
                self._free.append(swap.slot)

    # -- events -----------------------------------------------------------------------------
    def take_events(self) -> list[TierEvent]:
        """The changes since the last call, in order."""
        events, self._events = self._events, []
        return events

    def take_forgotten(self) -> list[int]:
        """The hashes that left the index since the last call, in order: whatever holds their
        bytes (a disk tier's files) may go. Taken when they leave, not when their slot frees,
        so that a newer copy stored under the same hash is never the one removed."""
        forgotten, self._forgotten = self._forgotten, []
        return forgotten

    # -- helpers ----------------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        victim, _ = self._lru.popitem(last=False)
        self.num_evictions += 1
        entry = self._blocks[victim]
        self._release(entry, announce=True)
        return self._free.pop()

    def _busy_entry(self, digest: int, slot: int) -> TierBlock:
        entry = self._blocks.get(digest)
        if entry is None or entry.slot != slot:
            entry = self._dropped.get(slot)
        if entry is None or entry.block_hash != digest:
            raise ValueError(f"tier slot {slot} holds no block {digest:#x}")
        return entry

    def _drop(self, entry: TierBlock) -> None:
        """Make a busy entry unreadable at once; its slot waits for its transfers."""
        readable = entry.readable
        entry.dropped = True
        del self._blocks[entry.block_hash]
        self._lru.pop(entry.block_hash, None)
        self._dropped[entry.slot] = entry
        self._forgotten.append(entry.block_hash)
        if readable and entry.announced:
            self._events.append(TierEvent(True, (entry.block_hash,), self.medium))

    def _release(self, entry: TierBlock, announce: bool) -> None:
        if self._dropped.get(entry.slot) is entry:
            del self._dropped[entry.slot]
        elif self._blocks.get(entry.block_hash) is entry:
            del self._blocks[entry.block_hash]
            self._lru.pop(entry.block_hash, None)
            self._forgotten.append(entry.block_hash)
        self._free.append(entry.slot)
        if announce and entry.announced:
            self._events.append(TierEvent(True, (entry.block_hash,), self.medium))

    def _announce_stored(self, entry: TierBlock) -> None:
        if entry.announced:
            digests, parent, tokens = (entry.block_hash,), entry.parent_hash, entry.token_ids
            self._events.append(TierEvent(False, digests, self.medium, parent, tokens, entry.root))
