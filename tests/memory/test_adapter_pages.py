"""LoRA adapter pages in the KV block pool: residency, pins, eviction order, admission counts."""

from __future__ import annotations

import pytest

from pagedkv.memory import KVCacheManager, KVTier, PoolExhaustedError, TieredKVCacheManager
from pagedkv.memory.adapter_pages import AdapterPages, AdapterPagesError, AdapterUsage, ResidentAdapter

BLOCK_SIZE = 2


def make(num_blocks: int) -> tuple[KVCacheManager, AdapterPages]:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, watermark=0.0)
    return kv, AdapterPages(kv.pool)


def test_idle_adapters_count_as_free_and_stay_until_needed():
    kv, pages = make(10)
    blocks = pages.load("sql", 3)
    assert len(blocks) == 3 and all(kv.pool.refcount(b) == 1 for b in blocks)
    assert kv.pool.num_free_blocks == 10  # idle: its pages can be taken back
    kv.allocate("s1", list(range(14)))  # 7 blocks: plain free ones only
    assert pages.is_resident("sql") and pages.block_ids("sql") == blocks
    kv.allocate("s2", [1, 2])  # one more than the plain free blocks: the adapter gives way
    assert not pages.is_resident("sql")
    assert pages.take_evicted() == ["sql"] and pages.take_evicted() == []
    assert kv.pool.num_free_blocks == 2


def test_a_pinned_adapter_is_never_taken_back():
    kv, pages = make(6)
    blocks = pages.load("sql", 4)
    pages.pin("sql")
    assert kv.pool.num_free_blocks == 2 and pages.blocks_to_admit("sql", 4) == 0
    with pytest.raises(PoolExhaustedError):
        kv.allocate("s1", list(range(6)))
    assert pages.block_ids("sql") == blocks
    with pytest.raises(ValueError, match="used by 1 running sequence"):
        pages.unload("sql")
    pages.unpin("sql")
    assert pages.blocks_to_admit("sql", 4) == 4  # idle pages count as free: pinning takes them
    assert pages.unload("sql") and kv.pool.num_free_blocks == 6 and kv.pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="not pinned"):
        pages.unpin("sql")


def test_cached_kv_blocks_go_before_idle_adapters_and_adapters_go_oldest_first():
    kv, pages = make(8)
    kv.allocate("s", [1, 2, 3, 4, 5])  # 3 blocks, 2 of them full
    kv.cache_computed_blocks("s", [1, 2, 3, 4, 5], 5)
    kv.free("s")  # 2 cached-free blocks, 6 plain free
    pages.load("old", 2)
    pages.load("new", 2)
    pages.load("old", 2)  # used again: now the younger one
    assert [r.adapter_id for r in pages.resident()] == ["new", "old"]
    kv.allocate("t", list(range(20, 24)))  # 2 blocks: the plain free ones
    assert kv.pool.num_cached_free_blocks == 2
    kv.allocate("u", list(range(30, 34)))  # 2 blocks: the cached-free KV blocks go first
    assert kv.pool.num_cached_free_blocks == 0 and pages.usage().resident_adapters == 2
    kv.allocate("v", [40, 41])  # 1 block: the least recently used adapter gives way
    assert [r.adapter_id for r in pages.resident()] == ["old"]
    assert pages.usage() == AdapterUsage(1, 0, 2, 0, loads=2, evictions=1)


def test_a_load_that_cannot_fit_changes_nothing():
    kv, pages = make(5)
    pages.load("a", 2)
    pages.pin("a")
    kv.allocate("s", [1, 2, 3, 4])
    before = (kv.usage(), pages.resident())
    with pytest.raises(AdapterPagesError, match="LoRA adapter 'b' needs 2 page.*only 1 of 5"):
        pages.load("b", 2)
    assert (kv.usage(), pages.resident()) == before
    with pytest.raises(ValueError, match="resident in 2 page"):
        pages.load("a", 3)
    with pytest.raises(ValueError, match="positive integer"):
        pages.load("c", 0)
    with pytest.raises(KeyError, match="'c' is not resident"):
        pages.pin("c")


def test_admission_pins_a_resident_adapter_before_its_kv_blocks_are_taken():
    kv, pages = make(8)
    blocks = pages.load("sql", 2)  # the least recently used adapter
    pages.load("other", 2)
    prompt = list(range(12))  # 6 KV blocks: 4 plain free, 2 reclaimed from an idle adapter
    needed = kv.blocks_to_allocate(prompt)
    assert needed + pages.blocks_to_admit("sql", 2) == 8 == kv.pool.num_free_blocks
    pages.admit("sql", 2, needed, lambda: kv.allocate("s", prompt))
    assert pages.block_ids("sql") == blocks and pages.pins("sql") == 1
    assert pages.resident() == [ResidentAdapter("sql", tuple(blocks), 1)]
    assert pages.take_evicted() == ["other"]
    assert pages.take_writes() == [("sql", tuple(blocks))] and pages.take_writes() == []


def test_admission_loads_a_missing_adapter_after_its_kv_blocks_share_the_cached_prefix():
    kv, pages = make(8)
    prompt, younger = [1, 2, 3, 4, 5], [20, 21, 22, 23, 24]
    for seq, tokens in (("first", prompt), ("second", younger)):
        kv.allocate(seq, tokens)
        kv.cache_computed_blocks(seq, tokens, 5)
        kv.free(seq)  # 2 cached-free blocks each, the prompt's the oldest
    kv.allocate("other", list(range(10, 16)))  # 3 blocks: one plain free block is left
    needed = kv.blocks_to_allocate(prompt)  # 1 new block + 2 revived hits
    assert needed == 3 and kv.pool.num_free_blocks == 5
    with pytest.raises(AdapterPagesError, match="needs 6 page"):
        pages.admit("sql", 3, needed, lambda: kv.allocate("s", prompt))
    assert "s" not in kv and not pages.is_resident("sql")
    # Loaded first, the adapter would have evicted the oldest cached blocks: the prompt's hits.
    assert pages.admit("sql", 2, needed, lambda: kv.allocate("s", prompt)) == 4
    assert pages.pins("sql") == 1 and kv.pool.num_free_blocks == 0
    assert kv.blocks_to_allocate(younger) == 3  # the younger cached prefix gave way


def test_a_failed_kv_allocation_leaves_no_pin():
    kv, pages = make(4)
    pages.load("sql", 1)

    def refuse():
        raise PoolExhaustedError(9, 3, 4)

    with pytest.raises(PoolExhaustedError):
        pages.admit("sql", 1, 0, refuse)
    assert pages.pins("sql") == 0 and pages.usage().idle_pages == 1


def test_one_reclaimer_per_pool():
    kv, _ = make(4)
    with pytest.raises(ValueError, match="already has a reclaimer"):
        AdapterPages(kv.pool)


def test_an_evicted_adapter_is_not_written():
    kv, pages = make(3)
    pages.load("a", 2)
    kv.allocate("s", [1, 2, 3, 4, 5, 6])  # takes a's pages before the worker heard of them
    assert pages.take_writes() == [] and pages.take_evicted() == ["a"]


def test_with_a_second_tier_a_load_spills_the_cached_blocks_it_evicts():
    kv = TieredKVCacheManager(4, BLOCK_SIZE, KVTier(8), 1000, watermark=0.0)
    pages = AdapterPages(kv.pool)
    prompt = [1, 2, 3, 4, 5]
    kv.allocate("s", prompt)
    kv.cache_computed_blocks("s", prompt, 5)
    kv.free("s")  # 2 cached-free blocks, 2 plain free
    kv.take_transfers()
    blocks = pages.load("sql", 3)
    spilled = [spill.block_id for spill in kv.take_transfers().spills]
    assert len(spilled) == 1 and spilled[0] in blocks  # read out before the adapter is written there
