"""Experiment (a): the issue's figures on the normal workload, and a consistent breakdown."""

import numpy as np
import pytest

from pagedkv.sim.simulate import SimConfig
from pagedkv.sim.snapshot import ALLOCATORS, ClosedLoop, take_snapshot
from pagedkv.sim.workloads import Workload

BATCH_SIZES = (10, 25, 50, 100, 150, 200)


@pytest.fixture(scope="module")
def snapshots():
    config = SimConfig()  # normal workload, block size 16, seed 0
    workload = config.make_workload("normal")
    return [take_snapshot(workload, n, 16, config.rng(1, n)) for n in BATCH_SIZES]


def test_paged_is_at_least_98_percent_and_naive_max_20_to_30(snapshots):
    for snap in snapshots:
        assert snap.breakdowns["paged"].utilization >= 0.98, snap.batch_size
        assert 0.20 <= snap.breakdowns["max"].utilization <= 0.30, snap.batch_size


def test_the_allocators_are_ordered_as_in_figure_2(snapshots):
    for snap in snapshots:
        u = {name: snap.breakdowns[name].utilization for name in ALLOCATORS}
        assert u["max"] < u["pow2"] < u["oracle"] < u["paged"], snap.batch_size


def test_breakdown_categories(snapshots):
    for snap in snapshots:
        b = snap.breakdowns
        tokens = b["paged"].token_states
        assert all(b[name].token_states == tokens for name in ALLOCATORS)  # same requests everywhere
        # All contiguous policies reserve from admission, so they hold the same reservation.
        assert b["max"].reservation == b["pow2"].reservation == b["oracle"].reservation > 0
        assert b["max"].external_fragmentation == 0  # equal-sized regions always refill a hole
        assert b["oracle"].internal_fragmentation == 0
        assert b["pow2"].external_fragmentation > 0 and b["oracle"].external_fragmentation > 0
        # Paged: only the unfilled ends of last blocks, less than one block per request.
        assert b["paged"].reservation == b["paged"].external_fragmentation == 0
        assert 0 < b["paged"].internal_fragmentation < 16 * snap.batch_size
        assert abs(sum(b["max"].fractions().values()) - 1) < 1e-12


def test_the_loop_keeps_exactly_n_requests_mid_life():
    loop = ClosedLoop(Workload("sharegpt"), 37, np.random.default_rng(3))
    for step in (0, 500, 5000):
        loop.advance_to(step)
        live = loop.live()
        assert len(live) == 37
        assert all(r.request.prompt_len <= r.tokens < r.request.final_len for r in live)
        for allocator in loop.allocators.values():
            assert allocator.num_live == 37


def test_same_seed_same_snapshot_and_bad_sizes_refused():
    a = take_snapshot(Workload(), 20, 16, np.random.default_rng(5), moments=2)
    b = take_snapshot(Workload(), 20, 16, np.random.default_rng(5), moments=2)
    assert a == b
    with pytest.raises(ValueError, match="batch size"):
        take_snapshot(Workload(), 0, 16, np.random.default_rng(0))
    with pytest.raises(ValueError, match="moment"):
        take_snapshot(Workload(), 5, 16, np.random.default_rng(0), moments=0)
