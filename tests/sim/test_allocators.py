"""Contiguous baselines: reservation policies and first-fit placement on a real address space."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.sim.allocators import ContiguousAllocator, FirstFitSpace, reservation_slots
from pagedkv.sim.workloads import Request


def test_reservation_policies():
    r = Request(100, 200)
    assert reservation_slots("max", r, 2048) == 2048
    assert reservation_slots("pow2", r, 2048) == 512
    assert reservation_slots("oracle", r, 2048) == 300
    assert reservation_slots("pow2", Request(256, 256), 2048) == 512  # a power of two stays itself
    assert reservation_slots("pow2", Request(1500, 100), 3000) == 2048
    assert reservation_slots("pow2", Request(2000, 500), 3000) == 3000  # capped at the context
    with pytest.raises(ValueError, match="unknown contiguous policy"):
        reservation_slots("best", r, 2048)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        reservation_slots("max", Request(2000, 100), 2048)


def test_first_fit_reuses_the_lowest_hole_and_leaves_external_fragmentation():
    space = FirstFitSpace(100)
    a, b, c = space.allocate(30), space.allocate(30), space.allocate(30)
    assert (a, b, c) == (0, 30, 60)
    space.free(a, 30)
    space.free(c, 30)
    # 70 slots are free, but in holes of 30 and 40: a 50-slot region does not fit.
    assert space.allocate(50) is None
    assert space.largest_hole == 40
    assert space.allocate(20) == 0  # lowest hole that fits, not the best fit
    assert space.footprint == 60
    space.free(b, 30)
    space.free(0, 20)
    assert space.allocated == 0 and space.largest_hole == 100 and space.footprint == 0


def test_double_free_is_refused():
    space = FirstFitSpace(100)
    start = space.allocate(10)
    space.free(start, 10)
    with pytest.raises(ValueError, match="double free"):
        space.free(start, 10)
    with pytest.raises(ValueError, match="positive"):
        space.allocate(0)
    with pytest.raises(ValueError, match="positive"):
        FirstFitSpace(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), max_size=80))
def test_first_fit_matches_a_slot_by_slot_model(ops):
    """Against a bitmap: each allocation lands at the lowest run of free slots that is long enough."""
    capacity = 200
    space = FirstFitSpace(capacity)
    used = [False] * capacity
    live: list[tuple[int, int]] = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            expected = next(
                (s for s in range(capacity - size + 1) if not any(used[s : s + size])),
                None,
            )
            assert space.allocate(size) == expected
            if expected is not None:
                used[expected : expected + size] = [True] * size
                live.append((expected, size))
        else:
            start, size = live.pop(pick % len(live))
            space.free(start, size)
            used[start : start + size] = [False] * size
        assert space.allocated == sum(used)
        top = max((s + n for s, n in live), default=0)
        assert space.footprint == top


def test_contiguous_allocator_tracks_regions():
    alloc = ContiguousAllocator("oracle", 2048, capacity_slots=1000)
    assert alloc.try_allocate(1, Request(100, 300))
    assert alloc.try_allocate(2, Request(200, 300))
    assert not alloc.try_allocate(3, Request(50, 60))  # 110 > 100 slots left: nothing changes
    assert alloc.num_live == 2 and alloc.reserved_slots == 900 and alloc.final_total == 900
    assert alloc.region(2) == (400, 500)
    alloc.free(1)
    assert alloc.try_allocate(3, Request(50, 60))
    assert alloc.region(3) == (0, 110)
    with pytest.raises(ValueError, match="already holds"):
        alloc.try_allocate(3, Request(1, 1))
    with pytest.raises(ValueError, match="unknown contiguous policy"):
        ContiguousAllocator("buddy", 2048)
