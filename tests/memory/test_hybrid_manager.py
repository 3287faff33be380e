"""The hybrid KV cache manager hands a sliding group's blocks back once out of its window, and
a prefix hit shares only the blocks each window still reads."""

from pagedkv.memory.hybrid_manager import HybridKVCacheManager
from pagedkv.memory.kv_groups import plan_kv_groups

GEMMA2_LIKE = plan_kv_groups([8, None])  # one sliding layer (window 8), one full layer


def test_blocks_out_of_the_window_return_to_the_pool():
    kv = HybridKVCacheManager(64, GEMMA2_LIKE, block_size=4, enable_prefix_caching=False, watermark=0.0)
    prompt = list(range(40))
    kv.allocate("a", prompt)
    assert kv.pool.num_used_blocks == 1 + 2 * 10  # the null block, then both groups' whole prompt
    kv.cache_computed_blocks("a", prompt, 40)
    full, sliding = kv.grouped("a").tables
    assert len(full.block_ids) == 10
    # The next query (position 40) sees keys 33..40: blocks 8 and 9 only.
    assert sliding.block_ids[:8] == [kv.null_block] * 8 and kv.null_block not in sliding.block_ids[8:]
    assert kv.pool.num_used_blocks == 1 + 10 + 2
    for token in range(40, 100):
        kv.append_slots("a")
        kv.cache_computed_blocks("a", list(range(token + 1)), token + 1)
    assert kv.pool.num_used_blocks == 1 + 25 + 2  # 100 tokens: the full group grows, the window does not
    kv.free("a")
    assert kv.pool.num_used_blocks == 1


def test_a_prefix_hit_shares_what_each_window_still_reads():
    kv = HybridKVCacheManager(64, GEMMA2_LIKE, block_size=4, watermark=0.0)
    prompt = list(range(40))
    kv.allocate("a", prompt)
    first_full, first_sliding = (list(t.block_ids) for t in kv.grouped("a").tables)
    kv.cache_computed_blocks("a", prompt, 40)
    assert kv.allocate("b", prompt) == 36  # never the last token
    full, sliding = kv.grouped("b").tables
    assert full.block_ids[:9] == first_full[:9]
    # Position 36 sees keys 29..36: blocks 7 (back from the cached-free queue) and 8 (held by
    # "a"); the earlier ones are null.
    assert sliding.block_ids[:7] == [kv.null_block] * 7 and sliding.block_ids[7:9] == first_sliding[7:9]


def test_a_hit_needs_every_group():
    """Once a sliding chain's oldest block is evicted, the chain is gone and so is the hit."""
    kv = HybridKVCacheManager(24, GEMMA2_LIKE, block_size=4, watermark=0.0)
    prompt = list(range(40))
    kv.allocate("a", prompt)
    kv.cache_computed_blocks("a", prompt, 40)
    kv.free("a")
    kv.allocate("big", [99] * 40)  # takes 20 blocks: the LRU cached-free ones go first
    assert kv.cached_prefix_blocks(prompt) == []


def test_a_sliding_group_holds_a_prompt_chunk_by_chunk():
    """With the step's token budget known, admission holds the first chunk's sliding blocks only;
    each later chunk takes its own once the window's old ones went back."""
    kv = HybridKVCacheManager(
        64, GEMMA2_LIKE, block_size=4, enable_prefix_caching=False, watermark=0.0, max_chunk_tokens=8
    )
    prompt = list(range(40))
    assert kv.blocks_to_allocate(prompt) == 10 + 2
    kv.allocate("a", prompt)
    full, sliding = kv.grouped("a").tables
    assert len(full.block_ids) == 10 and len(sliding.live_block_ids()) == 2
    assert len(kv.block_ids("a")) == 2 * 10 and sliding.num_pending == 8
    most = 0
    for start in range(0, 40, 8):
        assert kv.try_hold("a", start, start + 8)
        most = max(most, len(sliding.live_block_ids()))
        kv.cache_computed_blocks("a", prompt, start + 8)
    # A step from p reads keys above p - 8: two blocks before the chunk, and the chunk's two.
    assert most == 4 and sliding.num_pending == 0
    assert kv.held_blocks("a") == 10 + 2
    assert 10 + most <= kv.peak_blocks(40, 41) < 2 * 10
    kv.free("a")
    assert kv.pool.num_used_blocks == 1


def test_a_chunk_that_does_not_fit_changes_nothing_but_the_window():
    kv = HybridKVCacheManager(
        14, GEMMA2_LIKE, block_size=4, enable_prefix_caching=False, watermark=0.0, max_chunk_tokens=8
    )
    kv.allocate("a", list(range(40)))  # 10 full blocks, 2 sliding: the pool (13 less the null) is full
    assert kv.pool.num_free_blocks == 1
    kv.cache_computed_blocks("a", list(range(40)), 8)
    assert not kv.try_hold("a", 8, 24)  # blocks 2..5 of which 0..1 are held: 4 new, 1 free
    assert kv.pool.num_free_blocks == 1 and kv.grouped("a").tables[1].num_pending == 8
    assert kv.try_hold("a", 8, 12)
    assert kv.pool.num_free_blocks == 0
