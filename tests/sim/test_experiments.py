"""Experiments (c)-(f): block-size trade-off, prefix sharing, capacity, the worked example."""

import numpy as np
import pytest

from pagedkv.memory import blocks_for
from pagedkv.sim.experiments import (
    at_random_progress,
    block_size_sweep,
    capacity,
    prefix_sharing,
    worked_example,
)
from pagedkv.sim.simulate import SimConfig
from pagedkv.sim.workloads import Workload


def test_worked_example_is_96_vs_6144():
    ex = worked_example()
    assert ex.naive_slots == 6144 and ex.paged_slots == 96 and ex.ratio == 64
    assert [len(ids) for ids in ex.block_ids] == [2, 3, 1]
    # Grown one token at a time in turn, the requests' blocks interleave in the pool.
    assert sorted(b for ids in ex.block_ids for b in ids) == list(range(6))
    assert ex.block_ids[0] == (0, 3)
    assert ex.regions == ((0, 2048), (2048, 2048), (4096, 2048))
    with pytest.raises(ValueError, match="example lengths"):
        worked_example(lengths=(10, 3000))


def test_capacity_ratio_is_at_least_3x_on_the_default_gpu():
    config = SimConfig()
    fits = capacity(config.make_workload("normal"), config.kv_slots, 16, np.random.default_rng(0))
    assert fits["max"] == config.kv_slots // 2048 == 61
    assert fits["max"] < fits["pow2"] < fits["oracle"] < fits["paged"]
    assert fits["paged"] / fits["max"] >= 3


def test_block_size_sweep_trades_waste_for_table_entries():
    live = at_random_progress(Workload().sample(np.random.default_rng(0), 100), np.random.default_rng(1))
    rows = block_size_sweep([live], [1, 2, 4, 8, 16, 32, 64, 128, 256])
    assert rows[0].wasted_slots == 0 and rows[0].table_entries == sum(r.tokens for r in live)
    for small, large in zip(rows, rows[1:], strict=False):
        assert small.wasted_slots <= large.wasted_slots
        assert small.table_entries >= large.table_entries
    for row in rows:
        assert row.table_entries == sum(blocks_for(r.tokens, row.block_size) for r in live)
        assert 0 <= row.wasted_slots < row.block_size * len(live)
    with pytest.raises(ValueError, match="at least one batch"):
        block_size_sweep([], [16])


@pytest.mark.parametrize(("prefix_len", "block_size", "cow"), [(600, 16, 49), (608, 16, 0), (600, 1, 0)])
def test_prefix_sharing_holds_the_prompt_once(prefix_len, block_size, cow):
    workload = Workload("shared-prefix", prefix_len=prefix_len)
    result = prefix_sharing(workload, 50, block_size, np.random.default_rng(0))
    rng = np.random.default_rng(0)  # the same draws prefix_sharing makes: requests, then progress
    live = at_random_progress(workload.sample(rng, 50), rng)
    own = [blocks_for(r.tokens, block_size) for r in live]
    full = prefix_len // block_size
    assert result.shared_blocks == full
    assert result.blocks_without_sharing == sum(own)
    # Full prompt blocks once, everything else (the partial block's copies included) per request.
    assert result.blocks_with_sharing == full + sum(n - full for n in own)
    assert result.cow_copies == cow  # every request but the last copies a shared partial block
    with pytest.raises(ValueError, match="shared-prefix"):
        prefix_sharing(Workload("normal"), 5, 16, np.random.default_rng(0))
