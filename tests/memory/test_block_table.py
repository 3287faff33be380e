import pytest

from pagedkv.memory import BlockPool, BlockTable, PoolExhaustedError, blocks_for


def test_blocks_are_taken_only_on_boundaries():
    pool = BlockPool(10, block_size=4)
    table = BlockTable(pool)
    taken = []
    for _ in range(9):
        table.append_slots(1)
        taken.append(len(table.block_ids))
    assert taken == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert table.capacity - table.num_tokens == 3


def test_slots_follow_the_block_table():
    pool = BlockPool(10, block_size=4)
    pool.allocate(3)  # make the table's blocks non-contiguous with position
    table = BlockTable(pool)
    table.append_slots(6)
    b0, b1 = table.block_ids
    assert table.slots(0, 6) == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    assert table.slot(5) == b1 * 4 + 1
    with pytest.raises(IndexError):
        table.slot(8)


def test_fork_shares_and_cow_copies_only_the_partial_last_block():
    pool = BlockPool(10, block_size=4)
    parent = BlockTable(pool)
    parent.append_slots(6)
    child = parent.fork()
    assert child.block_ids == parent.block_ids
    assert all(pool.refcount(b) == 2 for b in parent.block_ids)
    assert child.blocks_needed(1) == 1
    copies = child.append_slots(1)
    assert copies == [(parent.block_ids[1], child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0]
    assert pool.refcount(parent.block_ids[0]) == 2
    assert pool.refcount(parent.block_ids[1]) == 1
    # The parent now owns its last block alone: no copy for it.
    assert parent.append_slots(1) == []


def test_fork_at_a_boundary_needs_no_copy():
    pool = BlockPool(10, block_size=4)
    parent = BlockTable(pool)
    parent.append_slots(8)
    child = parent.fork()
    assert child.append_slots(1) == []
    assert child.block_ids[:2] == parent.block_ids


def test_failed_append_changes_nothing():
    pool = BlockPool(3, block_size=4)
    table = BlockTable(pool)
    table.append_slots(10)
    other = table.fork()
    before = (list(table.block_ids), table.num_tokens, pool.num_free_blocks)
    with pytest.raises(PoolExhaustedError):
        other.append_slots(7)  # CoW copy + 1 new block, only 0 free
    assert (list(table.block_ids), table.num_tokens, pool.num_free_blocks) == before
    assert other.num_tokens == 10
    assert other.try_append(1) is None  # the copy-on-write copy alone does not fit either
    assert (list(other.block_ids), other.num_tokens, pool.num_free_blocks) == (before[0], 10, 0)
    table.free()  # the shared blocks now have one holder: no copy, room in the last block
    assert other.try_append(2) == [] and other.num_tokens == 12


def test_free_returns_everything():
    pool = BlockPool(5, block_size=2)
    table = BlockTable(pool)
    table.append_slots(7)
    child = table.fork()
    table.free()
    assert pool.num_used_blocks == 4
    child.free()
    assert pool.num_used_blocks == 0


@pytest.mark.parametrize("n,bs,expected", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (25, 16, 2)])
def test_blocks_for(n, bs, expected):
    assert blocks_for(n, bs) == expected


def test_truncate_frees_the_blocks_left_empty():
    """Rolled-back speculative tokens: the slots go, and so does a block holding nothing else."""
    pool = BlockPool(10, block_size=4)
    table = BlockTable(pool)
    table.append_slots(6)  # a partial second block
    kept = list(table.block_ids)
    table.append_slots(5)  # proposals spill into a third block
    assert len(table.block_ids) == 3
    table.truncate(7)
    assert table.block_ids == kept and table.num_tokens == 7
    assert pool.num_used_blocks == 2
    table.truncate(7)  # nothing to drop
    assert table.num_tokens == 7 and pool.num_used_blocks == 2
    with pytest.raises(ValueError, match="cannot truncate"):
        table.truncate(8)


def test_truncate_keeps_a_reservation_when_asked():
    pool = BlockPool(10, block_size=4)
    table = BlockTable(pool)
    table.append_slots(2)
    table.reserve(12)
    table.truncate(1, free_blocks=False)
    assert table.num_tokens == 1 and len(table.block_ids) == 3


def test_truncate_refuses_to_free_a_shared_block():
    """A block past the kept tokens only ever held unverified tokens: never a shared one."""
    pool = BlockPool(10, block_size=4)
    table = BlockTable(pool)
    table.append_slots(8)
    child = table.fork()
    with pytest.raises(RuntimeError, match="shared or cached"):
        table.truncate(3)
    assert table.num_tokens == 8  # refused: nothing changed
    child.free()
    table.truncate(3)
    assert len(table.block_ids) == 1 and pool.num_used_blocks == 1
