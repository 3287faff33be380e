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
