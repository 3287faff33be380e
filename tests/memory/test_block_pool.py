import pytest

from pagedkv.memory import BlockPool, PoolExhaustedError


def test_allocate_hands_out_distinct_blocks_and_refcounts():
    pool = BlockPool(8, block_size=4)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5
    assert all(pool.refcount(b) == 1 for b in blocks)
    assert pool.num_used_blocks == 5 and pool.num_free_blocks == 3


def test_exhaustion_is_all_or_nothing_and_names_the_numbers():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(PoolExhaustedError, match=r"2 block\(s\) needed, 1 free of 4"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])


def test_shared_block_returns_only_when_last_holder_frees():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref(b)
    pool.free([b])
    assert pool.num_used_blocks == 1
    pool.free([b])
    assert pool.num_used_blocks == 0


def test_a_free_uncached_block_cannot_be_shared():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="free"):
        pool.incref(0)


def test_cached_blocks_survive_free_and_are_evicted_lru_only_when_needed():
    pool = BlockPool(3, block_size=2)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, -1, [1, 2])
    pool.cache_block(b, -1, [3, 4])
    pool.free([a])
    pool.free([b])
    pool.free([c])
    assert pool.num_cached_free_blocks == 2 and pool.num_free_blocks == 3
    # The plain free block goes first, then the least recently freed cached one (a).
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]
    assert pool.match_prefix([1, 2], 1) == []
    assert pool.match_prefix([3, 4], 1) == [b]
    assert pool.num_evictions == 1


def test_evicting_a_parent_forgets_its_cached_children():
    pool = BlockPool(2, block_size=1)
    parent, child = pool.allocate(2)
    pool.cache_block(parent, -1, [7])
    pool.cache_block(child, parent, [8])
    pool.free([child, parent])
    assert pool.match_prefix([7, 8], 2) == [parent, child]
    pool.allocate(1)  # evicts the oldest: child was freed first
    assert pool.match_prefix([7, 8], 2) == [parent]
    pool.free(pool.allocate(1))  # evicts parent
    assert pool.num_cached_blocks == 0


def test_only_full_held_blocks_are_cached():
    pool = BlockPool(2, block_size=4)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError, match="full blocks"):
        pool.cache_block(b, -1, [1, 2])
    pool.free([b])
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_block(b, -1, [1, 2, 3, 4])


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_pool_size_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)
