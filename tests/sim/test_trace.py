"""Experiment (b): the event-driven trace loops against plain token-by-token references."""

import math
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.memory import BlockPool, BlockTable, PoolExhaustedError, blocks_for
from pagedkv.sim.allocators import ContiguousAllocator
from pagedkv.sim.simulate import SimConfig, trace_arrivals
from pagedkv.sim.trace import WATERMARK, run_contiguous, run_paged
from pagedkv.sim.workloads import Workload, poisson_arrivals


def make_arrivals(workload, rate, steps, seed):
    rng = np.random.default_rng(seed)
    counts = poisson_arrivals(rng, rate, steps)
    requests = iter(workload.sample(rng, int(counts.sum())))
    return [(t, next(requests)) for t, n in enumerate(counts) for _ in range(n)]


def reference_paged(arrivals, num_blocks, block_size, steps):
    """Every running request appends one slot per step; the policy of run_paged, spelled out."""
    pool = BlockPool(num_blocks, block_size)
    watermark = math.ceil(WATERMARK * num_blocks)
    waiting, running = deque(), {}  # key -> [table, stored tokens]
    resume = [r.prompt_len for _, r in arrivals]
    epochs = [0] * len(arrivals)
    completed = preemptions = 0
    series = []
    for t in range(steps):
        for key in [k for k, (_, c) in running.items() if c + 1 == arrivals[k][1].final_len]:
            running.pop(key)[0].free()
            epochs[key] += 1
            completed += 1
        before = {k: c for k, (_, c) in running.items()}
        preempted = False
        for key in sorted(running, key=lambda k: (epochs[k], k)):
            while key in running:
                try:
                    running[key][0].append_slots(1)
                    running[key][1] += 1
                    break
                except PoolExhaustedError:
                    victim = next(reversed(running))
                    resume[victim] = before[victim]
                    running.pop(victim)[0].free()
                    epochs[victim] += 1
                    waiting.appendleft(victim)
                    preemptions += 1
                    preempted = True
        waiting.extend(k for k, (step, _) in enumerate(arrivals) if step == t)
        while waiting and not preempted:
            key = waiting[0]
            if pool.num_free_blocks - blocks_for(resume[key], block_size) < watermark:
                break
            waiting.popleft()
            table = BlockTable(pool)
            table.append_slots(resume[key])
            running[key] = [table, resume[key]]
        tokens = sum(c for _, c in running.values())
        series.append((len(running), tokens, pool.num_used_blocks * block_size, bool(waiting)))
    return series, completed, preemptions


def reference_contiguous(policy, arrivals, capacity, max_seq_len, steps):
    allocator = ContiguousAllocator(policy, max_seq_len, capacity)
    waiting, running = deque(), {}  # key -> stored tokens
    completed, series = 0, []
    for t in range(steps):
        for key in [k for k, c in running.items() if c + 1 == arrivals[k][1].final_len]:
            del running[key]
            allocator.free(key)
            completed += 1
        for key in running:
            running[key] += 1
        waiting.extend(k for k, (step, _) in enumerate(arrivals) if step == t)
        while waiting and allocator.try_allocate(waiting[0], arrivals[waiting[0]][1]):
            key = waiting.popleft()
            running[key] = arrivals[key][1].prompt_len
        series.append((len(running), sum(running.values()), allocator.reserved_slots, bool(waiting)))
    return series, completed


def averages(series, capacity):
    """Time averages of (token states, held, external fragmentation, free) from a series."""
    steps = len(series)
    return (
        sum(s[1] for s in series) / steps,
        sum(s[2] for s in series) / steps,
        sum(capacity - s[2] for s in series if s[3]) / steps,
        sum(capacity - s[2] for s in series if not s[3]) / steps,
    )


def assert_series_match(result, series):
    """The per-step series a run keeps are the reference's, step by step."""
    assert result.running == [s[0] for s in series]
    assert result.stored == [s[1] for s in series]
    assert result.held == [s[2] for s in series]
    assert [w > 0 for w in result.waiting] == [s[3] for s in series]


def assert_residencies_replay(result, block_size):
    """Redrawing memory from the residencies alone gives the run's series at every step, and no
    slot is ever held by two requests (block_size None: contiguous regions)."""
    steps = len(result.running)
    owner = {}  # slot or block -> (residency index, left)
    for t in range(steps):
        live = [(i, r) for i, r in enumerate(result.residencies) if r.admitted <= t < r.left]
        assert len(live) == result.running[t]
        assert sum(r.stored_at(t) for _, r in live) == result.stored[t]
        held = 0
        for i, r in live:
            if block_size is None:
                start, size = r.placement
                units = range(start, start + size)
                held += size
            else:
                units = r.placement[: blocks_for(r.stored_at(t), block_size)]
                held += len(units) * block_size
            for unit in units:
                assert owner.get(unit, (i, 0))[0] == i or owner[unit][1] <= t, f"slot {unit} shared"
                owner[unit] = (i, r.left)
        assert held == result.held[t]


@pytest.mark.parametrize(("block_size", "num_blocks", "seed"), [(16, 120, 0), (4, 400, 1), (32, 60, 2)])
def test_paged_trace_matches_token_by_token_reference(block_size, num_blocks, seed):
    """A pool small enough that requests are preempted and recomputed."""
    arrivals = make_arrivals(Workload(max_seq_len=256), 0.15, 700, seed)
    result = run_paged(arrivals, num_blocks, block_size, 256, 700)
    series, completed, preemptions = reference_paged(arrivals, num_blocks, block_size, 700)
    assert preemptions > 0  # the scenario exercises preemption
    assert (result.completed, result.preemptions) == (completed, preemptions)
    assert_series_match(result, series)
    assert_residencies_replay(result, block_size)
    b = result.breakdown
    tokens, held, external, free = averages(series, num_blocks * block_size)
    assert b.token_states == pytest.approx(tokens)
    assert b.reserved - b.external_fragmentation == pytest.approx(held)
    assert b.external_fragmentation == pytest.approx(external) and b.free == pytest.approx(free)
    assert b.reservation == 0


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_contiguous_trace_matches_token_by_token_reference(policy):
    arrivals = make_arrivals(Workload("sharegpt", max_seq_len=512), 0.1, 800, 3)
    result = run_contiguous(policy, arrivals, 3000, 512, 800)
    series, completed = reference_contiguous(policy, arrivals, 3000, 512, 800)
    assert result.completed == completed and result.preemptions == 0
    assert_series_match(result, series)
    assert_residencies_replay(result, None)
    tokens, held, external, free = averages(series, 3000)
    b = result.breakdown
    assert b.token_states == pytest.approx(tokens)
    assert b.reserved - b.external_fragmentation == pytest.approx(held)
    assert b.external_fragmentation == pytest.approx(external) and b.free == pytest.approx(free)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 4, 16]),
    slots=st.integers(256, 1200),
    rate=st.floats(0.02, 0.3),
)
def test_residencies_redraw_every_step_of_any_run(seed, block_size, slots, rate):
    """Whatever the load (preemptions included), the residencies alone give each step's memory
    and never put two requests in one block or slot."""
    arrivals = make_arrivals(Workload(max_seq_len=128), rate, 150, seed)
    assert_residencies_replay(run_paged(arrivals, slots // block_size, block_size, 128, 150), block_size)
    assert_residencies_replay(run_contiguous("oracle", arrivals, slots, 128, 150), None)


@pytest.mark.timeout(60)
def test_default_trace_runs_200_requests_at_once():
    """The default trace: ~200 requests in flight on an 80 GB GPU; it is event-driven, so it takes
    seconds (the timeout is a generous ceiling, not a measurement)."""
    config = SimConfig()
    rate, arrivals = trace_arrivals(config)
    paged = run_paged(arrivals, config.kv_slots // 16, 16, 2048, config.trace_steps)
    naive = run_contiguous("max", arrivals, config.kv_slots, 2048, config.trace_steps)
    assert paged.peak_running >= 200
    assert naive.peak_running == config.kv_slots // 2048
    assert paged.completed > 2 * naive.completed
    assert paged.breakdown.utilization >= 0.98
    assert 0.2 <= naive.breakdown.utilization <= 0.3


def test_trace_refuses_memory_smaller_than_one_request():
    arrivals = make_arrivals(Workload(), 0.1, 10, 0)
    with pytest.raises(ValueError, match="fewer|less than one"):
        run_contiguous("max", arrivals, 1000, 2048, 10)
    with pytest.raises(ValueError, match="less than one"):
        run_paged(arrivals, 10, 16, 2048, 10)
