"""LoRA adapters paged in the KV block pool, as the scheduler sees them (S-LoRA's unified paging).

:class:`~pagedkv.memory.adapter_pages.AdapterPages` keeps which adapters are resident in which
blocks; this wraps it with what the scheduler knows of a sequence: each known adapter's folder,
pages and checksum (registered when the adapter is added), and which sequences pin their adapter.
A sequence pins its adapter from its admission (or its fork) until it finishes or is preempted,
exactly while it holds a block table, so the pages of an adapter in use are never reclaimed and
an idle adapter's pages are the pool's last resort after its cached-free KV blocks.

With a second KV tier (:class:`~pagedkv.memory.tier.adapter_entries.AdapterTierCopies`) an idle
adapter an allocation evicts is spilled to the tier, and a load of an adapter the tier holds
whole is planned from it, the folder read only if the copy fails its check; removing an adapter
drops its tier entries.

Invariant: an adapter's pin count equals the number of sequences in :attr:`PagedAdapters.pinned`
that run with it; a sequence is unpinned at most once (``release`` of one not pinned does nothing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from pagedkv.engine.core.scheduler_output import SchedulerOutput
from pagedkv.engine.core.sequence import Sequence
from pagedkv.memory.adapter_pages import AdapterPages
from pagedkv.memory.adapters import PageWrite, SlotLoad
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.manager import KVCacheManager
from pagedkv.memory.tier.adapter_entries import AdapterTierCopies


@dataclass(frozen=True)
class AdapterFile:
    """A known adapter's name and folder, the pages its weights take, and its weights file's
    CRC-32."""

    name: str
    path: str
    pages: int
    checksum: int


@dataclass(frozen=True)
class AdapterBlocks:
    """One LoRA adapter resident in pages of the pool (unified paging): its pages in the order
    its weights fill them, and how many running sequences pin it (0: idle, its pages reclaimable
    after the cached-free blocks), and where its weights came from."""

    lora_int_id: int
    name: str
    block_ids: tuple[int, ...]
    pins: int
    #: Where its weights last came from: "file" (its folder) or "tier" (the second KV tier).
    loaded_from: str = "file"


class PagedAdapters:
    """The pool's adapter pages and the sequences that pin them (see the module docstring)."""

    def __init__(self, pool: BlockPool, tier: AdapterTierCopies | None = None) -> None:
        self.pages = AdapterPages(pool)
        self.tier = tier
        if tier is not None:
            self.pages.on_evict = self._spill
        self._spilled = 0  # the tier's pages_spilled at the last step's stats
        #: Adapter id -> where its last load read its weights ("file" or "tier").
        self._source: dict[int, str] = {}
        self._files: dict[int, AdapterFile] = {}
        #: Sequence ids that pin their adapter.
        self.pinned: set[object] = set()

    def register(self, lora_int_id: int, file: AdapterFile) -> None:
        self._files[lora_int_id] = file

    def forget(self, lora_int_id: int) -> None:
        """An adapter removed: its pages go back now (a ValueError while a sequence pins it), and
        its tier entries are dropped."""
        self.pages.unload(lora_int_id)
        file = self._files.pop(lora_int_id, None)
        self._source.pop(lora_int_id, None)
        if self.tier is not None and file is not None:
            self.tier.forget(lora_int_id, file.checksum, file.pages)

    def spill_resident(self) -> int:
        """With a disk tier, plan a copy of every resident adapter's pages into it (at shutdown,
        beside the pool's cached blocks: the next engine on the folder finds them); returns the
        pages planned. A host tier ends with the process: nothing."""
        if self.tier is None or self.tier.manager.tier.medium != "DISK":
            return 0
        return sum(self.tier.spill(a, self._files[a].checksum, b) for a, b in self.pages.written())

    def _spill(self, lora_int_id: int, block_ids: list[int]) -> None:
        self.tier.spill(lora_int_id, self._files[lora_int_id].checksum, block_ids)  # type: ignore[union-attr]

    def pages_of(self, lora_int_id: int) -> int:
        try:
            return self._files[lora_int_id].pages
        except KeyError:
            raise KeyError(f"LoRA adapter {lora_int_id} was not registered for paging") from None

    def blocks_to_admit(self, seq: Sequence) -> int:
        """Blocks ``seq``'s adapter takes from the pool beyond its KV blocks (0 for the base model
        or an adapter already pinned)."""
        lora_id = seq.request.lora_int_id
        return 0 if lora_id is None else self.pages.blocks_to_admit(lora_id, self.pages_of(lora_id))

    def allocate(
        self, kv_manager: KVCacheManager, seq: Sequence, token_ids: list[int], reserve: int, *lookup: Any
    ) -> int:
        """``kv_manager.allocate`` of ``seq``'s blocks with its adapter loaded and pinned around
        it, all or nothing (:meth:`AdapterPages.admit`); returns the cached tokens."""
        lora_id = seq.request.lora_int_id
        if lora_id is None:
            return kv_manager.allocate(seq.seq_id, token_ids, reserve, *lookup)
        kv_blocks = kv_manager.blocks_to_allocate(token_ids, reserve, *lookup)
        cached = self.pages.admit(
            lora_id,
            self.pages_of(lora_id),
            kv_blocks,
            lambda: kv_manager.allocate(seq.seq_id, token_ids, reserve, *lookup),
        )
        self.pinned.add(seq.seq_id)
        return cached

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares ``parent``'s table, so it pins the adapter too."""
        if parent.seq_id in self.pinned:
            self.pages.pin(child.request.lora_int_id)
            self.pinned.add(child.seq_id)

    def release(self, seq: Sequence) -> None:
        """``seq`` gave its block table back (finished or preempted): its pin goes."""
        if seq.seq_id in self.pinned:
            self.pinned.discard(seq.seq_id)
            self.pages.unpin(seq.request.lora_int_id)

    def take_writes(self) -> list[PageWrite]:
        """The adapters loaded since the last call, for the worker to write into their pages."""
        writes = []
        for lora_id, blocks in self.pages.take_writes():
            file = self._files[lora_id]
            from_tier = self.tier is not None and self.tier.load(lora_id, file.checksum, blocks)
            writes.append(PageWrite(lora_id, file.path, file.checksum, blocks, from_tier))
            self._source[lora_id] = "tier" if from_tier else "file"
        return writes

    def retry(self, writes: Iterable[PageWrite]) -> None:
        """The step carrying ``writes`` failed: the next one writes those adapters again."""
        for write in writes:
            self.pages.rewrite(write.lora_int_id)

    def step_stats(self, out: SchedulerOutput) -> dict[str, int]:
        """The ``lora_*`` fields of the step's :class:`~pagedkv.engine.stats.StepStats`."""
        usage = self.pages.usage()
        tier_loads = sum(write.from_tier for write in out.lora_page_writes)
        return {
            "lora_page_loads": len(out.lora_page_writes),
            "lora_page_tier_loads": tier_loads,
            "lora_page_file_reads": len(out.lora_page_writes) - tier_loads,
            **self._tier_stats(),
            "lora_page_evictions": len(out.lora_evicted),
            "lora_adapters_resident": usage.resident_adapters,
            "lora_pages_resident": usage.resident_pages,
            "lora_pages_pinned": usage.pinned_pages,
        }

    def _tier_stats(self) -> dict[str, int]:
        """Adapters whose tier copy failed its check, and pages spilled, since the last call."""
        if self.tier is None:
            return {}
        spilled, self._spilled = self.tier.pages_spilled - self._spilled, self.tier.pages_spilled
        failed = self.tier.take_failed()
        self._source.update(dict.fromkeys(failed, "file"))
        return {"lora_page_tier_fallbacks": len(failed), "lora_page_spills": spilled}

    def snapshot(self) -> tuple[AdapterBlocks, ...]:
        """Every resident adapter's pages and pins, pinned ones first (the block map's)."""
        return tuple(
            AdapterBlocks(
                r.adapter_id,
                self._files[r.adapter_id].name,
                r.block_ids,
                r.pins,
                self._source.get(r.adapter_id, "file"),
            )
            for r in self.pages.resident()
        )

    def with_pages(self, loads: list[SlotLoad]) -> list[SlotLoad]:
        """``loads`` pointed at their adapters' pages (each is pinned by the sequence admitted
        with it, so resident)."""
        return [replace(load, pages=tuple(self.pages.block_ids(load.lora_int_id))) for load in loads]
