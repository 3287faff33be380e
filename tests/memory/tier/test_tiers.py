"""The second tier's bookkeeping, one decision at a time: spill on eviction, load on a prefix hit,
swap or recompute on preemption, pins and writes in flight, events, warm-restart indexing."""

import pytest

from pagedkv.memory import (
    ROOT,
    KVCacheManager,
    KVTier,
    PoolExhaustedError,
    SwapCostModel,
    TieredKVCacheManager,
    TransferReport,
    block_hash,
)
from pagedkv.memory.block_hash import chain_hashes
from pagedkv.server.kv_events import block_hash as published_hash

BS = 4


def tiered(num_blocks=4, capacity=8, **kwargs) -> TieredKVCacheManager:
    return TieredKVCacheManager(num_blocks, BS, KVTier(capacity), 1000, watermark=0.0, **kwargs)


def run(kv: TieredKVCacheManager):
    """Take this step's moves and acknowledge them all (a host tier)."""
    transfers = kv.take_transfers()
    kv.complete(transfers.done())
    return transfers


def fill(kv, seq, tokens):
    """Admit ``tokens`` and count them computed (as a finished prefill would)."""
    cached = kv.allocate(seq, tokens)
    kv.cache_computed_blocks(seq, tokens, len(tokens))
    return cached


def test_the_chained_hash_is_the_one_kv_events_publish():
    tokens = list(range(12))
    hashes = chain_hashes(tokens, BS, 0, 3, None)
    assert hashes[0] == block_hash(None, tokens[:4]) == published_hash(None, tokens[:4])
    assert hashes[2] == published_hash(published_hash(hashes[0], tokens[4:8]), tokens[8:12])
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(hashes[0], [1, 2, 3, 4])  # the parent counts


def test_an_evicted_cached_block_is_spilled_then_loaded_back_instead_of_recomputed():
    kv = tiered(num_blocks=3)
    prompt = list(range(9))  # two full blocks and one token
    fill(kv, "a", prompt)
    run(kv)
    kv.free("a")  # blocks 0, 1 cached-free; the partial block 2 plain free
    fill(kv, "b", [50 + t for t in range(9)])  # takes all three blocks: evicts both cached ones
    spills = run(kv).spills
    assert sorted(s.block_id for s in spills) == [0, 1]
    assert {s.block_hash for s in spills} == set(chain_hashes(prompt, BS, 0, 2, None))
    assert kv.tier.num_blocks == 2 and kv.blocks_spilled == 2
    kv.free("b")
    assert kv.allocate("c", prompt) == 8  # both full blocks come back from the tier
    loads = run(kv).loads
    assert [load.block_id for load in loads] == kv.block_ids("c")[:2]
    assert [load.block_hash for load in loads] == chain_hashes(prompt, BS, 0, 2, None)
    assert (kv.tier_query_tokens, kv.tier_hit_tokens) == (27, 8)  # every prompt asked, "c" found

    assert kv.prefix_hit_tokens == 0


def test_a_block_the_tier_already_holds_is_not_spilled_again():
    kv = tiered(num_blocks=3)
    prompt = list(range(9))
    fill(kv, "a", prompt)
    kv.free("a")
    fill(kv, "b", [50 + t for t in range(9)])
    run(kv)
    kv.free("b")
    fill(kv, "c", prompt)  # loads both blocks, and caches them in the pool again
    run(kv)
    kv.free("c")
    fill(kv, "d", [70 + t for t in range(9)])  # evicts them once more
    assert [s.block_hash for s in run(kv).spills] != chain_hashes(prompt, BS, 0, 2, None)
    assert kv.tier.num_blocks == 4  # "a"'s two blocks once, "b"'s two (evicted by "c")


def test_a_spill_in_flight_is_not_loaded_and_a_failed_write_is_forgotten():
    kv = tiered(num_blocks=3)
    prompt = list(range(9))
    fill(kv, "a", prompt)
    kv.free("a")
    fill(kv, "b", [50 + t for t in range(9)])
    spills = kv.take_transfers().spills  # a disk tier: the writes have not ended yet
    kv.free("b")
    assert kv.allocate("c", prompt) == 0  # storing: not readable
    kv.take_transfers()
    kv.free("c")
    first, second = sorted(spills, key=lambda s: s.block_hash == chain_hashes(prompt, BS, 0, 1, None)[0])
    kv.complete(TransferReport(stored=[(first.slot, False), (second.slot, True)]))
    assert kv.tier.get(first.block_hash) is None and kv.tier.get(second.block_hash).readable
    events = kv.take_tier_events()
    assert [(e.removed, e.block_hashes) for e in events] == [(False, (second.block_hash,))]
    assert events[0].medium == "CPU" and events[0].token_ids == tuple(prompt[:4])


def test_pinned_blocks_are_not_evicted_and_events_say_what_left():
    tier = KVTier(2, "DISK")
    digests = chain_hashes(list(range(12)), BS, 0, 3, None)
    parents = [None, digests[0], digests[1]]
    slots = [tier.store(digests[i], parents[i], range(i * BS, (i + 1) * BS)) for i in range(2)]
    for digest, slot in zip(digests, slots, strict=False):
        tier.stored(digest, slot)
    (entry,) = tier.match(list(range(12)), BS, 0, 1, None)
    tier.pin([entry])
    assert tier.store(digests[2], parents[2], range(8, 12)) == slots[1]  # the unpinned one went
    assert tier.store(99, None, [0, 0, 0, 0]) is None  # the only other slot is pinned
    tier.unpin(entry.block_hash, entry.slot)
    events = tier.take_events()
    assert [(e.removed, e.block_hashes, e.medium) for e in events] == [
        (False, (digests[0],), "DISK"),
        (False, (digests[1],), "DISK"),
        (True, (digests[1],), "DISK"),
    ]


def test_a_hit_compares_parent_and_tokens_not_only_the_hash():
    tier = KVTier(4)
    tokens = [1, 2, 3, 4]
    digest = block_hash(None, tokens)
    tier.stored(digest, tier.store(digest, 12345, tokens))  # a lie about its parent
    assert tier.match(tokens + [0], BS, 0, 1, None) == []
    assert tier.restore([(block_hash(None, [9, 9, 9, 9]), None, [1, 1, 1, 1])]) == {}  # torn index


def test_preemption_swaps_the_uncached_tail_and_readmission_brings_it_back():
    kv = tiered(num_blocks=4, preemption_mode="swap")
    tokens = list(range(10))  # blocks: full, full, two tokens
    fill(kv, "a", tokens)
    blocks = kv.block_ids("a")
    outcome = kv.preempt("a", tokens, 10)
    assert outcome.swapped and outcome.blocks_moved == 1 and outcome.tokens_kept == 10
    swap_outs = run(kv).swap_outs
    assert [block for block, _ in swap_outs] == [blocks[2]]  # the partial block; the rest is cached
    assert kv.num_swapped_preemptions == 1 and kv.tier.num_swap_slots == 1
    assert kv.allocate("a", tokens + [10]) == 10
    transfers = run(kv)
    assert [slot for slot, _ in transfers.swap_ins] == [slot for _, slot in swap_outs]
    assert kv.tier.num_swap_slots == 0 and kv.blocks_swapped_in == 1


def test_without_prefix_caching_every_computed_block_is_swapped():
    kv = TieredKVCacheManager(4, BS, KVTier(8), 1000, enable_prefix_caching=False, watermark=0.0)
    kv.preemption_mode = "swap"
    tokens = list(range(10))
    kv.allocate("a", tokens)
    assert kv.preempt("a", tokens, 9).blocks_moved == 3


def test_the_cost_model_picks_the_cheaper_way():
    model = SwapCostModel(copy_bytes_per_s=1e9, prefill_tokens_per_s=1e3)
    assert model.prefers_swap(num_bytes=1_000_000, num_tokens=100)  # 2 ms vs 100 ms
    assert not model.prefers_swap(num_bytes=1_000_000_000, num_tokens=100)  # 2 s vs 100 ms
    assert not model.prefers_swap(num_bytes=0, num_tokens=0)
    with pytest.raises(ValueError, match="positive"):
        SwapCostModel(copy_bytes_per_s=0)
    slow_copies = tiered(cost_model=SwapCostModel(copy_bytes_per_s=1.0))
    fill(slow_copies, "a", list(range(10)))
    assert not slow_copies.preempt("a", list(range(10)), 9).swapped
    assert slow_copies.num_recomputed_preemptions == 1 and slow_copies.tier.num_swap_slots == 0


def test_a_swap_that_does_not_fit_recomputes_and_one_whose_prefix_is_gone_falls_back():
    kv = tiered(num_blocks=4, capacity=1, preemption_mode="swap")
    fill(kv, "a", list(range(10)))
    kv.reset_prefix_cache()  # the cached prefix is gone: all three blocks would have to move
    assert not kv.preempt("a", list(range(10)), 9).swapped
    kv2 = tiered(num_blocks=3, capacity=2, preemption_mode="swap")
    tokens = list(range(10))
    fill(kv2, "a", tokens)
    assert kv2.preempt("a", tokens, 9).swapped
    run(kv2)
    fill(kv2, "b", [50 + t for t in range(12)])  # evicts "a"'s cached prefix; the tier is full
    run(kv2)
    kv2.free("b")
    assert kv2.allocate("a", tokens) < 9 and kv2.swap_fallbacks == 1
    assert kv2.tier.num_swap_slots == 0


def test_a_failed_load_shrinks_what_the_sequence_counts_computed():
    kv = tiered(num_blocks=3)
    prompt = list(range(9))
    fill(kv, "a", prompt)
    kv.free("a")
    fill(kv, "b", [50 + t for t in range(9)])
    run(kv)
    kv.free("b")
    assert kv.allocate("c", prompt) == 8
    loads = kv.take_transfers().loads
    kv.complete(TransferReport(loaded=[(loads[0].slot, True), (loads[1].slot, False)]))
    assert kv.take_load_failures() == {"c": 4}
    assert kv.tier.get(loads[1].block_hash) is None  # a torn copy is forgotten, never reused


def test_allocation_failure_changes_nothing():
    kv = tiered(num_blocks=3)
    fill(kv, "a", list(range(9)))
    kv.free("a")
    fill(kv, "b", [50 + t for t in range(9)])
    run(kv)
    kv.free("b")
    fill(kv, "c", [60] * 8)
    run(kv)
    before = (kv.usage(), kv.tier_usage(), kv.tier.take_events())
    with pytest.raises(PoolExhaustedError):
        kv.allocate("d", list(range(20)))
    assert (kv.usage(), kv.tier_usage(), kv.tier.take_events()) == before[:2] + ([],)
    assert kv.take_transfers().is_empty


def test_the_base_manager_is_unchanged_without_a_tier():
    kv = KVCacheManager(4, BS)
    kv.allocate("a", list(range(9)))
    kv.cache_computed_blocks("a", list(range(9)), 9)
    with pytest.raises(ValueError, match="does not hash"):
        kv.pool.prefix_cache.hash_of(kv.block_ids("a")[0])
    assert kv.pool.prefix_cache.parent_of(kv.block_ids("a")[1]) == kv.block_ids("a")[0] != ROOT
