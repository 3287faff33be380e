"""The plans carry block-table edits, not tables: the runner's tables follow the scheduler's.

A running sequence's table is sent once, then as the blocks it gains, so a decode's plan does
not grow with its context; whatever changes a table -- copy-on-write, a speculative rollback, a
preemption and re-admission, a fork -- the runner's table after the plan equals the KV cache
manager's, and a freed sequence's table leaves the runner.
"""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.engine.core.plan import SeqSlice, ShippedTables, StepPlan
from pagedkv.engine.worker.runner_tables import RunnerTables
from pagedkv.memory import KVCacheManager, PoolExhaustedError
from tests.checkpoints import make_checkpoint

OPS = ("admit", "append", "fork", "rollback", "free", "readmit")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_runners_tables_equal_the_managers_after_any_history(data):
    """Random admissions (sharing prefix-cache blocks), appends, forks whose appends copy on
    write, speculative rollbacks, frees and re-admissions under the same id; each step plans a
    random subset, sent as JSON: every planned table arrives equal, in the lists and in the
    padded array (whose rows and width start small, so they grow), and no freed one stays."""
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=True, watermark=0.0)
    shipped, runner = ShippedTables(), RunnerTables(rows=2, width=2)

    def step(planned: list[int]) -> None:
        plan = shipped.plan([SeqSlice(s, [1], 0, True) for s in planned], kv)
        runner.apply(StepPlan.from_dict(json.loads(json.dumps(plan.to_dict()))))
        for s in planned:
            assert runner[s] == kv.block_ids(s)
        assert set(runner) <= set(kv.seq_ids())
        if planned:
            width = max(len(kv.block_ids(s)) for s in planned)
            padded = [kv.block_ids(s) + [0] * (width - len(kv.block_ids(s))) for s in planned]
            assert runner.padded(planned, width).tolist() == padded

    next_id = 0
    for _ in range(data.draw(st.integers(1, 30))):
        live = kv.seq_ids()
        op = data.draw(st.sampled_from(OPS if live else ("admit",)))
        seq = data.draw(st.sampled_from(live)) if live else None
        try:
            if op == "admit":
                kv.allocate(next_id, data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=14)))
                next_id += 1
            elif op == "append":
                kv.append_slots(seq, data.draw(st.integers(1, 9)))
            elif op == "fork":
                kv.fork(seq, next_id)
                kv.append_slots(next_id, 1)  # a shared partial last block is copied on write
                next_id += 1
            elif op == "rollback":  # proposals appended and computed, then some rejected
                verified, proposed = kv.table(seq).num_tokens, data.draw(st.integers(1, 9))
                kv.append_slots(seq, proposed)
                step([seq])
                kv.truncate(seq, verified + data.draw(st.integers(0, proposed - 1)))
            elif op == "free":
                kv.free(seq)
            else:  # preempted, then admitted again under its id with other blocks
                kv.free(seq)
                kv.allocate(seq, data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=14)))
        except PoolExhaustedError:
            pass
        live = kv.seq_ids()
        step(data.draw(st.lists(st.sampled_from(live), unique=True)) if live else [])


def test_a_running_sequence_sends_only_the_blocks_it_gains():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False, watermark=0.0)
    shipped = ShippedTables()
    kv.allocate("a", [1] * 5)
    first = shipped.plan([SeqSlice("a", [1] * 5, 0, True)], kv)
    assert first.reset and [(e.keep, e.new_block_ids) for e in first.table_edits] == [(0, kv.block_ids("a"))]
    sizes = []
    for position in range(5, 120):
        held = list(kv.block_ids("a"))
        kv.append_slots("a", 1)
        plan = shipped.plan([SeqSlice("a", [1], position, True)], kv)
        grown = kv.block_ids("a")[len(held) :]
        assert [(e.keep, e.new_block_ids) for e in plan.table_edits] == (
            [(len(held), grown)] if grown else []
        )
        assert not plan.reset and not plan.finished
        sizes.append(len(pickle.dumps(plan.to_dict())))
    assert len(kv.block_ids("a")) == 30
    assert len(set(sizes)) == 2  # with a block id and without: not growing with the table
    kv.free("a")
    assert shipped.plan([], kv).finished == ["a"]


def test_a_runner_that_missed_a_plan_refuses_the_next():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False, watermark=0.0)
    shipped, runner = ShippedTables(), RunnerTables()
    kv.allocate(0, [1] * 4)
    shipped.plan([SeqSlice(0, [1] * 4, 0, True)], kv)  # never applied
    kv.append_slots(0, 1)
    with pytest.raises(ValueError, match="missed a plan"):
        runner.apply(shipped.plan([SeqSlice(0, [1], 4, True)], kv))
    shipped.reset()  # the next plan starts the runner over: whole tables
    runner.apply(plan := shipped.plan([SeqSlice(0, [1], 4, True)], kv))
    assert plan.reset and runner[0] == kv.block_ids(0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("table-edits"), "llama")


def _checked(engine) -> list[StepPlan]:
    """Check after every step that the runner's table of each planned sequence is the
    manager's and that the runner holds no freed table; returns the plans seen."""
    executor, kv, seen = engine.executor, engine.kv_manager, []
    inner = executor.execute

    def execute(plan: StepPlan):
        logits = inner(plan)
        tables = executor.runner.tables
        for piece in plan.slices:
            assert tables[piece.seq_id] == kv.block_ids(piece.seq_id)
        assert set(tables) <= set(kv.seq_ids())
        seen.append(plan)
        return logits

    executor.execute = execute
    return seen


def test_forks_copy_on_write_and_preemption_keep_the_engines_tables_in_step(model_path):
    llm = LLM(
        str(model_path),
        num_kv_blocks=24,
        block_size=4,
        max_num_batched_tokens=16,
        watermark=0.0,
        decode_headroom=0.0,
    )
    plans = _checked(llm.engine)
    prompts = [[20 + i, 30, 40, 50, 60, 70 + i] for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=1, ignore_eos=True))
    llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=3, max_tokens=6))
    assert any(edit.keep for plan in plans for edit in plan.table_edits)  # a table continued
    assert any(plan.block_copies for plan in plans)  # copy-on-write happened
    assert llm.engine.stats().preemptions > 0
    assert any(plan.finished for plan in plans)


def test_speculative_rollbacks_keep_the_engines_tables_in_step(model_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(str(model_path), block_size=4, speculative_config=spec)
    plans = _checked(llm.engine)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    llm.generate([prompt, prompt[1:]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert any(piece.num_spec_tokens for plan in plans for piece in plan.slices)
