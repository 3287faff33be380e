"""LoRA adapters' pages in the second KV tier: an idle adapter evicted from the pool is kept.

Under unified paging an idle adapter's pages are the pool's last resort
(:mod:`pagedkv.memory.adapter_pages`). With a second tier, an evicted adapter's pages are
spilled there as KV blocks are -- one tier entry per page, its bytes copied out before the step
reuses the block (on disk: a checked file) -- and its next load copies them back instead of
reading its folder. Each page's entry is named by the adapter's id, the CRC-32 of its weights
file and the page's index (:func:`page_entry`), under a parent hash no KV block has
(:data:`~pagedkv.memory.tier.slots.ADAPTER_PAGE_PARENT`): a prompt never matches one, a changed
weights file never matches its old pages, and a restarted disk tier indexes them again.

The entries take tier slots and age out like any block (least recently used first); a load
needs every page of the adapter readable, else the folder is read (and the missing pages spilled
again at the next eviction). A copy that fails its check on the way back -- a damaged disk file,
or bytes that are not what was written from the folder (the worker checks) -- is forgotten, and
the worker reads the folder in the same step (:mod:`pagedkv.engine.worker.lora_pages`).

Control plane, no torch: the bytes move with the step's other tier moves.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.memory.block_hash import block_hash
from pagedkv.memory.tier.manager import TieredKVCacheManager
from pagedkv.memory.tier.slots import ADAPTER_PAGE_PARENT, TierBlock


def page_entry(lora_id: int, checksum: int, index: int) -> tuple[int, tuple[int, ...]]:
    """The tier's name for page ``index`` of adapter ``lora_id`` (weights file CRC-32
    ``checksum``): its hash and the "tokens" the tier compares on every use."""
    tokens = (lora_id, checksum, index)
    return block_hash(ADAPTER_PAGE_PARENT, tokens), tokens


class AdapterTierCopies:
    """The adapters' entries in ``manager``'s tier: spills at eviction, loads at a reload."""

    def __init__(self, manager: TieredKVCacheManager) -> None:
        self.manager = manager
        #: page hash -> its adapter, for the pages spilled or loaded (until the adapter is forgotten)
        self._owner: dict[int, int] = {}
        self.pages_spilled = 0
        #: adapters read back from the tier, and those whose copy failed its check there
        self.loads = 0
        self.load_failures = 0

    def spill(self, lora_id: int, checksum: int, block_ids: Sequence[int]) -> int:
        """The pool evicts the adapter whose weights its pages ``block_ids`` hold: plan a copy of
        each page the tier lacks; returns the pages planned."""
        planned = 0
        for index, block in enumerate(block_ids):
            digest, tokens = page_entry(lora_id, checksum, index)
            self._owner[digest] = lora_id
            planned += self.manager.plan_spill(block, digest, ADAPTER_PAGE_PARENT, tokens)
        self.pages_spilled += planned
        return planned

    def load(self, lora_id: int, checksum: int, block_ids: Sequence[int]) -> bool:
        """Plan the adapter's pages back from the tier into ``block_ids``; False (nothing planned)
        unless every page is readable there under this id and checksum."""
        entries = [self._readable(*page_entry(lora_id, checksum, i)) for i in range(len(block_ids))]
        found = [entry for entry in entries if entry is not None]
        if len(found) != len(entries):
            return False
        self.manager.plan_loads(found, block_ids)
        self._owner.update((entry.block_hash, lora_id) for entry in found)
        self.loads += 1
        return True

    def take_failed(self) -> set[int]:
        """The adapters some page of which failed its check on a load since the last call."""
        failed = {self._owner[d] for d in self.manager.take_page_load_failures() if d in self._owner}
        self.load_failures += len(failed)
        return failed

    def forget(self, lora_id: int, checksum: int, pages: int) -> None:
        """An adapter removed: its entries leave the tier (a disk tier deletes their files)."""
        digests = [page_entry(lora_id, checksum, i)[0] for i in range(pages)]
        self.manager.tier.forget(digests)
        for digest in digests:
            self._owner.pop(digest, None)

    def _readable(self, digest: int, tokens: tuple[int, ...]) -> TierBlock | None:
        entry = self.manager.tier.get(digest)
        if entry is None or not entry.readable:
            return None
        return entry if (entry.parent_hash, entry.token_ids) == (ADAPTER_PAGE_PARENT, tokens) else None
