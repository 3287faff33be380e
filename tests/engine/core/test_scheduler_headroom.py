"""Decode headroom in the live engine: an offline batch on a small pool wastes no work.

Counted through the engine's own statistics (computed tokens per step, tokens dropped by
preemption), never through time.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedkv import LLM, SamplingParams
from pagedkv.engine.core.headroom import Refusal
from pagedkv.engine.core.sequence import SequenceStatus
from tests.checkpoints import make_checkpoint
from tests.engine.test_engine_invariants import SHARED, prompts  # the same prompt mix, shared prefixes too

#: Requests in the offline batch: enough to over-commit a 48-block pool without headroom.
BATCH = 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("headroom"), "llama")


def _batch(num: int) -> list[tuple[list[int], int]]:
    """Prompts of 6-33 tokens and outputs of 4-39: lengths that differ, as in a real batch."""
    return [
        ([20 + (7 * i + j) % 400 for j in range(6 + (5 * i) % 28)], 4 + (11 * i) % 36) for i in range(num)
    ]


def _run_batch(model_path, **options) -> tuple[dict, list]:
    """Run the batch to the end; the engine's totals and every step's record."""
    llm = LLM(str(model_path), num_kv_blocks=48, block_size=4, max_model_len=128, **options)
    engine = llm.engine
    for i, (prompt, max_tokens) in enumerate(_batch(BATCH)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step)
    totals = engine.stats()
    assert totals.kv.used_blocks == 0 and totals.kv_sequences == 0
    assert totals.generated_tokens == sum(m for _, m in _batch(BATCH))
    return totals, steps


def test_an_offline_batch_on_a_small_pool_recomputes_under_5_percent(model_path):
    totals, steps = _run_batch(model_path)
    computed = sum(step.num_tokens for step in steps)
    assert totals.dropped_tokens < 0.05 * computed
    # Paging's point survives: more requests run at once than under whole prompt + max_tokens
    # reservations (the contiguous oracle) in the same pool.
    _, oracle_steps = _run_batch(model_path, kv_policy="contiguous-oracle")
    assert _mean_running(steps) > _mean_running(oracle_steps)
    assert max(s.running for s in steps) > max(s.running for s in oracle_steps)


def _mean_running(steps) -> float:
    return sum(step.running for step in steps) / len(steps)


def test_without_headroom_the_same_batch_over_commits_and_recomputes(model_path):
    """The batch above is a real test: admitting on the prompt alone throws work away."""
    totals, steps = _run_batch(model_path, decode_headroom=0.0)
    assert totals.preemptions > 0
    assert totals.dropped_tokens > 0.05 * sum(step.num_tokens for step in steps)


# -- property: with headroom, random workloads never leak and never over-commit -----------------
@pytest.fixture(scope="module")
def engine_factory(model_path):
    # The step budget covers every decode plus any whole prompt, so a prompt admitted this step
    # finishes by the next and every running sequence gains one token per step: the projection
    # the headroom makes is then exact, and a preemption would be an admission error. Headroom
    # alone: with a fair share, a request over its share yields its growth to the others by
    # design (tests/engine/core/test_scheduler_fairness.py).
    return lambda: (
        LLM(
            str(model_path),
            num_kv_blocks=24,
            block_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=64,
            watermark=0.0,
            max_running_share=1.0,
        ).engine
    )


requests = st.tuples(prompts, st.integers(1, 30), st.integers(1, 3))
actions = st.lists(
    st.one_of(st.tuples(st.just("add"), requests), st.tuples(st.just("step"), st.integers(1, 6))),
    min_size=1,
    max_size=14,
)


def _check_blocks(engine):
    """Each block's refcount is the number of live tables holding it; only running
    sequences hold tables."""
    holders = Counter()
    for seq_id in engine.kv_manager.seq_ids():
        holders.update(engine.kv_manager.block_ids(seq_id))
    for block in range(engine.kv_manager.num_blocks):
        assert engine.kv_manager.pool.refcount(block) == holders[block]
    running = {seq.seq_id for seq in engine.scheduler.running}
    assert set(engine.kv_manager.seq_ids()) == running
    assert all(seq.status is SequenceStatus.RUNNING for seq in engine.scheduler.running)


#: A request admitted in a step shares the prefix of a running one (whose blocks then no longer
#: come back when it finishes) before a second request is weighed against the same projection.
SHARED_THEN_ADMITTED = [
    ("add", ([*SHARED, 20], 7, 1)),
    ("step", 1),
    ("add", ([*SHARED, *[20] * 6], 28, 2)),
    ("add", ([20] * 12, 23, 1)),
]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions)
@example(script=SHARED_THEN_ADMITTED)
def test_with_headroom_random_workloads_never_leak_and_never_preempt(engine_factory, script):
    engine = engine_factory()
    for i, (kind, arg) in enumerate(script):
        if kind == "add":
            prompt, max_tokens, n = arg
            if n * -(-(len(prompt) + max_tokens) // 4) > 24:
                continue  # its own samples outgrow the pool: no admission rule can help that
            params = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=i, ignore_eos=True)
            try:
                engine.add_request(f"r{i}", prompt, params)
            except ValueError:
                continue  # larger than the whole pool: refused up front, as it should be
        else:
            for _ in range(arg):
                engine.step()
                _check_blocks(engine)
    while engine.has_unfinished_requests():
        engine.step()
        _check_blocks(engine)
    totals = engine.stats()
    # Every running request kept room to grow to max_tokens: nothing was ever thrown away.
    assert totals.preemptions == 0 and totals.dropped_tokens == 0
    assert totals.kv.used_blocks == 0 and totals.kv_sequences == 0


# -- a refusal that stands skips the projection, and never changes a decision ------------------
def _records(engine, script, early_stops: bool = False) -> list[tuple]:
    """Every step's scheduling decisions for ``script`` (adds between steps), to the end;
    ``early_stops``: requests also end on a few common token ids, before ``max_tokens``."""
    records = []

    def step():
        if not engine.has_unfinished_requests():
            return
        engine.step()
        s = engine.last_step
        records.append((s.scheduled_seqs, s.prefill_tokens, s.decode_tokens, s.running, s.waiting))
        records.append((s.admission_blocked_by_kv, s.preemptions, s.kv_blocks_used))

    for i, (kind, arg) in enumerate(script):
        if kind == "add":
            prompt, max_tokens, n = arg
            stops = list(range(STOP_IDS)) if early_stops else []
            params = SamplingParams(
                max_tokens=max_tokens, n=n, temperature=1.0, seed=i, ignore_eos=True, stop_token_ids=stops
            )
            try:
                engine.add_request(f"r{i}", prompt, params)
            except ValueError:
                continue
        else:
            for _ in range(arg):
                step()
    while engine.has_unfinished_requests():
        step()
    return records


def _decisions(
    make_engine, script, monkeypatch, recompute_always: bool, early_stops: bool = False
) -> tuple[list[tuple], int]:
    """The step records, and how many admission checks a standing refusal answered."""
    skipped = 0
    stands = Refusal.stands

    def counted(refusal, *args):
        nonlocal skipped
        verdict = False if recompute_always else stands(refusal, *args)
        skipped += verdict
        return verdict

    with monkeypatch.context() as patch:
        patch.setattr(Refusal, "stands", counted)
        return _records(make_engine(), script, early_stops), skipped


chunky_engine = st.sampled_from([8, 64])
#: With early stops, a request also ends on any of the token ids below this (of the test
#: checkpoints' vocabulary): a few in a hundred sampled tokens.
STOP_IDS = 8  # a step budget that splits prompts into chunks, or not


#: Chunked prompts (a step budget of 8) and a newcomer within its share that takes back blocks
#: from a request over its share: a preemption in the middle of admission.
RECLAIMED_DURING_ADMISSION = [
    ("add", ([*SHARED, 20], 16, 2)),
    ("step", 1),
    ("add", ([*SHARED, *[20] * 10], 5, 3)),
    ("add", ([20], 1, 1)),
    ("add", ([20], 1, 1)),
    ("add", ([*SHARED, 20], 1, 1)),
]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions, chunky_engine, st.booleans(), st.sampled_from([1.0, 0.5]))
@example(script=RECLAIMED_DURING_ADMISSION, budget=8, early=False, ratio=1.0)
def test_a_standing_refusal_schedules_exactly_as_projecting(
    model_path, monkeypatch, script, budget, early, ratio
):
    """Also across finishes: requests that stop early (on a stop token) end the refusal, those
    that end at ``max_tokens`` as projected may not; with ``decode_headroom`` 0.5 they all end
    later than projected."""

    def make_engine():
        return LLM(
            str(model_path),
            num_kv_blocks=24,
            block_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=budget,
            decode_headroom=ratio,
        ).engine

    projected, _ = _decisions(make_engine, script, monkeypatch, recompute_always=True, early_stops=early)
    skipping, _ = _decisions(make_engine, script, monkeypatch, recompute_always=False, early_stops=early)
    assert skipping == projected


def test_the_offline_batch_skips_projections_and_schedules_the_same(model_path, monkeypatch):
    """On a 48-block pool a refused head is short of a few blocks, so its refusal stands a few
    steps at a time; what matters is that it stands at all, and changes nothing."""
    script = [("add", (prompt, max_tokens, 1)) for prompt, max_tokens in _batch(BATCH)]

    def make_engine():
        return LLM(str(model_path), num_kv_blocks=48, block_size=4, max_model_len=128).engine

    projected, _ = _decisions(make_engine, script, monkeypatch, recompute_always=True)
    skipping, skipped = _decisions(make_engine, script, monkeypatch, recompute_always=False)
    assert skipping == projected
    blocked_steps = sum(1 for record in projected[1::2] if record[0])
    assert 0 < skipped < blocked_steps
