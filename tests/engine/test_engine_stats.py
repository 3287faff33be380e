"""What the engine publishes: one StepStats per step, EngineStats totals, the KV block map.

Consumers (``LLM.kv_stats``, ``/metrics``, the demo, the benchmarks, the dashboard) read only
these records, so they must add up: the steps' counts sum to the totals, the pool's blocks are
in exactly one state, and the block map's refcounts are the tables that hold each block.
"""

from collections import Counter

import pytest

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.engine import RequestLimits
from tests.checkpoints import make_checkpoint

KV_STATS_KEYS = {
    "block_size",
    "blocks_total",
    "blocks_used",
    "blocks_free",
    "blocks_cached",
    "utilization",
    "preemptions",
    "preemptions_swapped",
    "preemptions_recomputed",
    "prefix_cache_queries_tokens",
    "prefix_cache_hits_tokens",
    "prefix_cache_hit_rate",
    "running",
    "waiting",
    "kv_cache_dtype",
    "bytes_per_token",
    "kv_cache_bytes",
    "tensor_parallel_size",
}
SHARED = list(range(10, 30))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("stats"), "llama")


def _engine(model_path, **options):
    # A budget above the pool: the requests outgrow it together and run by preemption.
    defaults = dict(
        num_kv_blocks=20,
        block_size=4,
        max_num_batched_tokens=24,
        watermark=0.0,
        decode_headroom=0.0,
        limits=RequestLimits(max_request_tokens=4096),
    )
    return LLM(str(model_path), **{**defaults, **options}).engine


def _check_block_map(engine):
    snapshot = engine.kv_snapshot()
    holders = Counter(b for seq in snapshot.sequences for b in seq.block_ids)
    owners = {}
    for seq in snapshot.sequences:
        assert seq.num_tokens <= len(seq.block_ids) * snapshot.block_size
        for block in seq.block_ids:
            owners.setdefault(block, set()).add(seq.request_id)
    for info in snapshot.blocks:
        assert info.refcount == holders[info.block_id]
        assert set(info.owners) == owners.get(info.block_id, set())
        assert len(info.owners) == len(set(info.owners))
    stats = engine.kv_stats()
    assert stats["blocks_used"] == sum(b.refcount > 0 for b in snapshot.blocks)
    assert stats["blocks_cached"] == sum(b.cached for b in snapshot.blocks)
    return snapshot


def test_steps_add_up_to_the_totals_and_the_pool_to_its_size(model_path):
    engine = _engine(model_path)
    expected_tokens = 0
    for i, n in enumerate((1, 2, 3)):
        params = SamplingParams(max_tokens=12, n=n, seed=i, ignore_eos=True)
        engine.add_request(f"r{i}", SHARED + [40 + i] * (i + 1), params)
        expected_tokens += 12 * n
    records, shared_seen = [], False
    while engine.has_unfinished_requests():
        engine.step()
        step = engine.last_step
        records.append(step)
        assert step.step == len(records)
        assert step.num_tokens <= 24 and step.scheduled_seqs > 0
        assert step.kv_blocks_used + step.kv_blocks_free == step.kv_blocks_total == 20
        assert step.kv_table_blocks_at_forward >= step.kv_blocks_at_forward
        assert 0 < step.kv_utilization <= 1
        assert step.running + step.waiting == sum(
            len([s for s in r.seqs if not s.is_finished]) for r in engine.requests.values()
        )
        snapshot = _check_block_map(engine)
        shared_seen |= any(b.refcount > 1 and len(b.owners) == 1 for b in snapshot.blocks)
    totals = engine.stats()
    assert shared_seen  # the samples of one request shared their prompt's blocks
    assert sum(r.generated_tokens for r in records) == totals.generated_tokens == expected_tokens
    assert sum(r.prompt_tokens for r in records) == totals.prompt_tokens == 3 * len(SHARED) + 6
    assert sum(r.finished_requests for r in records) == 3
    assert sum(r.preemptions for r in records) == totals.preemptions > 0  # 20 blocks are too few
    assert sum(r.dropped_tokens for r in records) == totals.dropped_tokens > 0
    kv_stats = engine.kv_stats()
    assert set(kv_stats) == KV_STATS_KEYS
    assert sum(r.prefix_cache_queries for r in records) == kv_stats["prefix_cache_queries_tokens"]
    assert sum(r.prefix_cache_hits for r in records) == kv_stats["prefix_cache_hits_tokens"] > 0
    assert kv_stats["preemptions"] == totals.preemptions == kv_stats["preemptions_recomputed"]
    assert kv_stats["preemptions_swapped"] == 0  # no second tier to swap to
    assert totals.kv.used_blocks == totals.kv_sequences == kv_stats["running"] == 0
    # every prompt token was computed at least once; recomputation after preemption adds more
    computed_prompts = sum(r.prefill_tokens for r in records)
    assert computed_prompts >= 3 * len(SHARED) + 6 - kv_stats["prefix_cache_hits_tokens"]


def test_a_beam_search_counts_every_beams_tokens(model_path):
    engine = _engine(model_path, num_kv_blocks=64)
    engine.add_beam_request("b", SHARED, BeamSearchParams(beam_width=3, max_tokens=5))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        _check_block_map(engine)
    totals = engine.stats()
    # first step: the prompt; then one token per live beam per step (3 once the width is reached)
    assert 5 <= totals.generated_tokens <= 3 * 5
    assert totals.steps == steps and engine.last_step.finished_requests == 1


def test_the_block_map_names_owners_and_cached_blocks(model_path):
    engine = _engine(model_path, num_kv_blocks=32)
    engine.add_request("a", SHARED, SamplingParams(max_tokens=2, n=2, seed=0, ignore_eos=True))
    engine.step()  # the prompt: 5 full blocks, computed and cached
    snapshot = _check_block_map(engine)
    assert snapshot.block_size == 4 and len(snapshot.blocks) == 32
    assert {(s.request_id, s.index) for s in snapshot.sequences} == {("a", 0), ("a", 1)}
    shared = [b for b in snapshot.blocks if b.refcount == 2]
    assert len(shared) == 5 and all(b.owners == ("a",) and b.cached for b in shared)
    while engine.has_unfinished_requests():
        engine.step()
    snapshot = _check_block_map(engine)
    assert not snapshot.sequences and all(b.refcount == 0 and not b.owners for b in snapshot.blocks)
    assert sum(b.cached for b in snapshot.blocks) == 5  # cached-free: reusable prefix content
