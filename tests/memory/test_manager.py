import pytest

from pagedkv.memory import KVCacheManager, PoolExhaustedError


def test_second_identical_prompt_hits_all_full_blocks_but_the_last_token():
    kv = KVCacheManager(16, block_size=4)
    prompt = list(range(10))
    assert kv.allocate("a", prompt) == 0
    kv.cache_computed_blocks("a", prompt, len(prompt))
    assert kv.allocate("b", prompt) == 8
    # Shared, not copied.
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert kv.prefix_query_tokens == 20 and kv.prefix_hit_tokens == 8


def test_prompt_of_exact_blocks_recomputes_its_last_block():
    kv = KVCacheManager(16, block_size=4)
    prompt = list(range(8))
    kv.allocate("a", prompt)
    kv.cache_computed_blocks("a", prompt, 8)
    assert kv.allocate("b", prompt) == 4  # never the block holding the last token


def test_prefix_shorter_than_a_block_cannot_hit():
    kv = KVCacheManager(16, block_size=4)
    kv.allocate("a", [1, 2, 3, 9, 9])
    kv.cache_computed_blocks("a", [1, 2, 3, 9, 9], 5)
    assert kv.allocate("b", [1, 2, 3, 7, 7]) == 0


def test_uncomputed_blocks_are_not_offered():
    kv = KVCacheManager(16, block_size=4)
    prompt = list(range(12))
    kv.allocate("a", prompt)
    kv.cache_computed_blocks("a", prompt, 5)  # a chunked prefill got through one block
    assert kv.allocate("b", prompt) == 4


def test_freed_cached_blocks_are_reused_then_evicted_under_pressure():
    kv = KVCacheManager(4, block_size=4, watermark=0.0)
    prompt = list(range(9))
    kv.allocate("a", prompt)
    kv.cache_computed_blocks("a", prompt, 9)
    kv.free("a")
    assert kv.usage().used_blocks == 0 and kv.usage().cached_free_blocks == 2
    assert kv.allocate("b", prompt) == 8
    kv.free("b")
    kv.allocate("c", list(range(100, 116)))  # needs all 4 blocks: evicts both cached ones
    assert kv.usage().cached_blocks == 0
    kv.free("c")
    assert kv.allocate("d", prompt) == 0


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(16, block_size=4, enable_prefix_caching=False)
    prompt = list(range(10))
    kv.allocate("a", prompt)
    kv.cache_computed_blocks("a", prompt, 10)
    assert kv.allocate("b", prompt) == 0
    assert kv.usage().cached_blocks == 0


def test_a_block_computed_twice_is_deduplicated_onto_the_cached_copy():
    """Two requests computed the same prefix at once: the later one shares the cached copy."""
    kv = KVCacheManager(16, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    kv.allocate("a", prompt)
    kv.allocate("b", prompt)  # nothing cached yet: b computes its own copy
    used = kv.usage().used_blocks
    kv.cache_computed_blocks("a", prompt, 5)
    kv.cache_computed_blocks("b", prompt, 5)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.usage().used_blocks == used - 2
    assert kv.allocate("c", prompt + [6]) == 4


def test_admission_respects_watermark_and_failed_allocate_changes_nothing():
    kv = KVCacheManager(10, block_size=4, watermark=0.2)
    assert kv.blocks_to_allocate(list(range(32))) <= kv.allocatable_blocks  # 8 blocks <= 10 - 2
    assert kv.blocks_to_allocate(list(range(33))) > kv.allocatable_blocks
    kv.allocate("a", list(range(32)))
    before = kv.usage()
    with pytest.raises(PoolExhaustedError):
        kv.allocate("b", list(range(100, 112)))
    assert kv.usage() == before and "b" not in kv


def test_fork_and_cow_through_the_manager():
    kv = KVCacheManager(10, block_size=4)
    kv.allocate("p", list(range(6)))
    kv.fork("p", "s1")
    assert kv.append_slots("s1") == [(kv.block_ids("p")[1], kv.block_ids("s1")[1])]
    kv.free("p")
    kv.free("s1")
    kv.free("s1")  # idempotent
    assert kv.usage().used_blocks == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(8, block_size=2)
    kv.allocate("a", [1, 2, 3])
    kv.cache_computed_blocks("a", [1, 2, 3], 3)
    kv.free("a")
    assert kv.reset_prefix_cache() == 1
    assert kv.usage().cached_blocks == 0 and kv.usage().free_blocks == 8


def test_errors_name_the_sequence():
    kv = KVCacheManager(4)
    with pytest.raises(KeyError, match="nope"):
        kv.append_slots("nope")
    kv.allocate("a", [1])
    with pytest.raises(ValueError, match="already"):
        kv.allocate("a", [1])


def test_reservation_holds_blocks_up_front_and_appends_fill_them():
    kv = KVCacheManager(20, block_size=4, enable_prefix_caching=False, watermark=0.0)
    assert kv.blocks_to_allocate(list(range(5)), reserve_tokens=32) == 8
    kv.allocate("a", list(range(5)), reserve_tokens=32)
    assert kv.usage().used_blocks == 8 and kv.table("a").num_tokens == 5
    for _ in range(27):
        assert kv.append_slots("a") == []
    assert kv.usage().used_blocks == 8
    assert kv.blocks_to_allocate([1], reserve_tokens=64) > kv.allocatable_blocks


def test_fork_without_sharing_copies_every_written_block():
    kv = KVCacheManager(20, block_size=4, enable_prefix_caching=False)
    kv.allocate("p", list(range(6)), reserve_tokens=12)
    copies = kv.fork("p", "c", share=False)
    parent, child = kv.block_ids("p"), kv.block_ids("c")
    assert copies == [(parent[0], child[0]), (parent[1], child[1])]
    assert not set(parent) & set(child) and len(child) == 3
    assert kv.table("c").num_tokens == 6
