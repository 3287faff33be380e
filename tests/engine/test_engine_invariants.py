"""Hypothesis drives the live engine with random mixes of requests on a tiny model.

Greedy and sampled requests, parallel samples (forks), beam searches, aborts, shared prompt
prefixes and a pool small enough to force preemption, interleaved with steps. After every
step each block's refcount equals the number of live sequences holding it, and only running
sequences hold blocks; when everything is done, every block is back in the pool.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.engine.core.sequence import SequenceStatus
from tests.checkpoints import make_checkpoint

SHARED = [10, 11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("invariants"), "llama")
    return lambda: (
        LLM(
            str(path),
            num_kv_blocks=24,
            block_size=4,
            max_num_batched_tokens=16,
            watermark=0.0,
            decode_headroom=0.0,
        ).engine
    )


prompts = st.builds(
    lambda shared, tail: (SHARED if shared else []) + tail,
    st.booleans(),
    st.lists(st.integers(20, 500), min_size=1, max_size=12),
)
requests = st.one_of(
    st.builds(lambda p, m: ("greedy", p, m), prompts, st.integers(1, 8)),
    st.builds(
        lambda p, m, n, s: ("sample", p, m, n, s),
        prompts,
        st.integers(1, 8),
        st.integers(1, 3),
        st.integers(0, 9),
    ),
    st.builds(lambda p, m, w: ("beam", p, m, w), prompts, st.integers(1, 5), st.integers(1, 3)),
)
actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), requests),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
    ),
    min_size=1,
    max_size=12,
)


def check(engine):
    pool = engine.kv_manager.pool
    holders = Counter()
    for seq_id in engine.kv_manager.seq_ids():
        holders.update(engine.kv_manager.block_ids(seq_id))
    for block in range(pool.num_blocks):
        assert pool.refcount(block) == holders.get(block, 0)
    running = {s.seq_id for s in engine.scheduler.running}
    assert set(engine.kv_manager.seq_ids()) == running
    for seq in engine.scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
    usage = engine.kv_manager.usage()
    assert usage.used_blocks + usage.free_blocks == usage.total_blocks
    # the published block map says the same as the pool
    snapshot = engine.kv_snapshot()
    assert [b.refcount for b in snapshot.blocks] == [pool.refcount(b) for b in range(pool.num_blocks)]
    assert Counter(b for seq in snapshot.sequences for b in seq.block_ids) == +holders


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=actions)
def test_random_request_mixes_keep_the_pool_whole(engine_factory, actions):
    engine = engine_factory()
    added = []
    for action in actions:
        if action[0] == "add":
            kind, prompt, max_tokens, *rest = action[1]
            request_id = str(len(added))
            if kind == "beam":
                engine.add_beam_request(
                    request_id, prompt, BeamSearchParams(beam_width=rest[0], max_tokens=max_tokens)
                )
            else:
                n, seed = rest if rest else (1, None)
                temperature = 0.0 if kind == "greedy" else 1.0
                params = SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n, seed=seed)
                engine.add_request(request_id, prompt, params)
            added.append(request_id)
        elif action[0] == "step":
            for _ in range(action[1]):
                engine.step()
                check(engine)
        elif added:
            engine.abort(added[action[1] % len(added)])
            check(engine)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        check(engine)
        steps += 1
        assert steps < 500, "the engine stopped making progress"
    assert engine.kv_manager.usage().used_blocks == 0
    assert not engine.kv_manager.seq_ids() and not engine.scheduler.has_work
