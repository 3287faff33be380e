"""Hypothesis runs the adapter pool machine of ``test_adapter_pages_invariants`` over a pool with
a second tier: idle adapters an allocation evicts are spilled to the tier, and a load the tier
can serve is planned from it.

A shadow executor stands in for the tensors: each pool block and tier slot holds a record of
what was written there. It performs each step's moves in the executor's order (spills out, then
loads in), then the adapters' writes from their folders and the forward pass's KV writes. What
must hold, beside the pool machine's invariants (no leak, refcounts equal holders, pins): every
adapter page the tier calls readable holds that page of that adapter; an adapter planned from
the tier gets exactly its pages back; every tier slot is free or has one owner; KV events never
announce an adapter's page; removing an adapter leaves none of its entries.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from pagedkv.memory import KVTier, TieredKVCacheManager
from pagedkv.memory.adapter_pages import AdapterPages
from pagedkv.memory.tier.adapter_entries import AdapterTierCopies, page_entry
from tests.memory.test_adapter_pages_invariants import ADAPTERS, BLOCK_SIZE, AdapterPoolMachine

#: Each adapter's id and the CRC-32 of its weights file (as the engine registers them).
IDS = {name: index + 1 for index, name in enumerate(ADAPTERS)}
CRC = 0x1234ABCD


class AdapterTierMachine(AdapterPoolMachine):
    @initialize(num_blocks=st.integers(5, 12), caching=st.booleans(), capacity=st.integers(1, 16))
    def setup(self, num_blocks, caching, capacity):
        tier = KVTier(capacity, "CPU")
        self.kv = TieredKVCacheManager(num_blocks, BLOCK_SIZE, tier, 1, caching, 0.0)
        self.pages = AdapterPages(self.kv.pool)
        self.copies = AdapterTierCopies(self.kv)
        self.pages.on_evict = lambda adapter, blocks: self.copies.spill(IDS[adapter], CRC, blocks)
        self.running, self.tokens, self.pinned_pages = {}, {}, {}
        self.next_id = 0
        self.block: dict[int, object] = {}  # pool block -> what was written there
        self.slot: dict[int, object] = {}  # tier slot -> what was copied there
        self.tier_loads = 0

    @rule()
    def worker_step(self):
        """One step: the writes decided (from the tier where it can), the moves, the writes."""
        writes = self.pages.take_writes()
        self.pages.take_evicted()
        from_tier = {a: self.copies.load(IDS[a], CRC, blocks) for a, blocks in writes}
        transfers = self.kv.take_transfers()
        for spill in transfers.spills:
            self.slot[spill.slot] = self.block.get(spill.block_id)
        for load in transfers.loads:
            self.block[load.block_id] = self.slot[load.slot]
        for adapter, blocks in writes:
            wanted = [("page", adapter, i) for i in range(len(blocks))]
            if from_tier[adapter]:
                assert [self.block[b] for b in blocks] == wanted, "the tier gave back other bytes"
                self.tier_loads += 1
            else:
                self.block.update(zip(blocks, wanted, strict=True))
        for seq in self.running:  # the forward pass writes the KV of every table's blocks
            self.block.update((b, ("kv", seq)) for b in self.kv.block_ids(seq))
        self.kv.complete(transfers.done())
        assert self.copies.take_failed() == set()

    @rule(adapter=st.sampled_from(list(ADAPTERS)))
    def load_then_step(self, adapter):
        """A load and the step that writes it, so adapters take turns often."""
        self.load(adapter)
        self.worker_step()

    @rule(adapter=st.sampled_from(list(ADAPTERS)))
    def unload(self, adapter):
        """A user's removal: its pages back, and its tier entries gone."""
        if self.pages.pins(adapter):
            return
        self.pages.unload(adapter)
        self.copies.forget(IDS[adapter], CRC, ADAPTERS[adapter])
        tier = self.kv.tier
        assert all(page_entry(IDS[adapter], CRC, i)[0] not in tier for i in range(ADAPTERS[adapter]))

    @invariant()
    def readable_adapter_entries_hold_their_pages(self):
        tier = self.kv.tier
        for adapter, pages in ADAPTERS.items():
            for i in range(pages):
                entry = tier.get(page_entry(IDS[adapter], CRC, i)[0])
                if entry is not None and entry.readable:
                    assert self.slot[entry.slot] == ("page", adapter, i)

    @invariant()
    def every_tier_slot_has_one_owner(self):
        tier = self.kv.tier
        owners, free = tier.slot_owners(), tier.free_slots()
        assert not set(owners) & set(free)
        assert sorted([*owners, *free]) == list(range(tier.capacity))

    @invariant()
    def no_event_announces_an_adapter_page(self):
        pages = {page_entry(IDS[a], CRC, i)[0] for a, n in ADAPTERS.items() for i in range(n)}
        for event in self.kv.take_tier_events():
            assert not set(event.block_hashes) & pages


TestAdapterTierInvariants = AdapterTierMachine.TestCase
TestAdapterTierInvariants.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_adapters_come_back_from_the_tier_in_the_machine():
    """The machine's interesting path is reachable: an adapter evicted, then loaded from the tier."""
    machine = AdapterTierMachine()
    machine.setup(num_blocks=8, caching=True, capacity=12)
    machine.load("d")  # 5 pages, idle
    machine.worker_step()  # written from its folder
    machine.admit([1, 2, 3, 4, 5], [0, 1, 2, 3, 0], "c")  # 3 pages + 5 KV blocks: "d" evicted
    machine.worker_step()  # "d" spilled
    assert not machine.pages.is_resident("d") and machine.copies.pages_spilled == 5
    machine._stopped(0)  # "c" idle
    machine.load("d")  # "c" evicted for it, and "d" planned from the tier
    machine.worker_step()
    assert machine.tier_loads == 1 and machine.copies.loads == 1
    machine.teardown()
