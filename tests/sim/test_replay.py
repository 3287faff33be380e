"""The replay's document: packed columns round-trip, frames stay bounded, and what the page is
given redraws exactly what the simulator's loops recorded."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.memory import parse_bytes
from pagedkv.sim import SimConfig, simulate
from pagedkv.sim.html_replay import render_replay
from pagedkv.sim.replay import (
    REPLAY_ALLOCATORS,
    frame_steps,
    pack,
    replay_document,
    series_at,
    unpack,
)
from pagedkv.sim.trace import Residency


@pytest.fixture(scope="module")
def small_result():
    """A simulation small enough to check step by step: 2,048 token slots, 400 trace steps."""
    return simulate(
        SimConfig(
            max_seq_len=256,
            gpu_memory=parse_bytes("2GiB"),
            weights_memory=parse_bytes("1GiB"),
            prefix_len=64,
            batch_sizes=(8,),
            sweep_batch_size=8,
            block_sizes=(16,),
            prefix_requests=8,
            trace_concurrency=16,
            trace_steps=400,
        )
    )


@given(st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_pack_round_trips(values):
    packed = pack(values)
    assert unpack(packed) == values
    assert packed["type"] == ("u16" if all(v < 2**16 for v in values) else "u32")


def test_pack_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="only integers"):
        pack([1, -1])
    with pytest.raises(ValueError, match="only integers"):
        pack([2**32])


@given(st.integers(1, 20_000), st.integers(1, 600))
def test_frames_are_bounded_and_span_the_run(steps, max_frames):
    frames = frame_steps(steps, max_frames)
    assert len(frames) == min(steps, max_frames)
    assert frames == sorted(set(frames)) and frames[-1] == steps - 1
    assert max_frames == 1 or frames[0] == 0


def test_frames_need_a_step_and_a_frame():
    with pytest.raises(ValueError, match="at least one"):
        frame_steps(0)
    with pytest.raises(ValueError, match="at least one"):
        frame_steps(10, 0)


def decoded(memory):
    """The residencies of one packed memory, as the page rebuilds them."""
    cols = {name: unpack(packed) for name, packed in memory["residencies"].items()}
    if memory["kind"] == "paged":
        ends = [sum(cols["num_blocks"][: i + 1]) for i in range(memory["count"])]
        starts = [0, *ends[:-1]]
        placements = [tuple(cols["blocks"][a:b]) for a, b in zip(starts, ends, strict=True)]
    else:
        placements = list(zip(cols["start"], cols["size"], strict=True))
    return [
        Residency(
            cols["request"][i],
            cols["admitted"][i],
            cols["left"][i],
            cols["tokens"][i],
            cols["final_len"][i],
            tuple(placements[i]),
        )  # fmt: skip
        for i in range(memory["count"])
    ]


def test_trace_scenario_packs_the_runs_residencies_and_samples_their_series(small_result):
    doc = replay_document(small_result, max_frames=64)
    trace = next(s for s in doc["scenarios"] if s["id"] == "trace")
    assert trace["frames"] == frame_steps(small_result.config.trace_steps, 64)
    assert [m["allocator"] for m in trace["memories"]] == list(REPLAY_ALLOCATORS)
    for memory in trace["memories"]:
        run = small_result.trace[memory["allocator"]]
        assert decoded(memory) == list(run.residencies)
        for name, values in memory["series"].items():
            assert values == [getattr(run, name)[step] for step in trace["frames"]]
        block_size = small_result.config.block_size if memory["kind"] == "paged" else None
        for k, step in enumerate(trace["frames"]):
            redrawn = series_at(run.residencies, step, block_size)
            assert {n: redrawn[n] for n in ("running", "stored", "held")} == {
                n: memory["series"][n][k] for n in ("running", "stored", "held")
            }
    paged = trace["memories"][-1]
    assert paged["num_blocks"] == small_result.config.kv_slots // small_result.config.block_size
    assert trace["start_frame"] == paged["series"]["running"].index(max(paged["series"]["running"]))


def test_a_run_with_too_many_block_ids_is_replayed_over_its_first_steps(small_result):
    paged_run = small_result.trace["paged"]
    budget = sum(len(r.placement) for r in paged_run.residencies) // 3
    trace = replay_document(small_result, max_block_ids=budget)["scenarios"][1]
    window = trace["steps"]
    assert 0 < window < small_result.config.trace_steps
    assert f"the first {window:,} steps" in trace["description"]
    assert trace["frames"] == frame_steps(window)
    for memory in trace["memories"]:
        run = small_result.trace[memory["allocator"]]
        kept = decoded(memory)
        assert all(r.admitted < window and r.left <= window for r in kept)
        if memory["kind"] == "paged":
            assert sum(len(r.placement) for r in kept) <= budget
        block_size = small_result.config.block_size if memory["kind"] == "paged" else None
        for step in range(window):  # every step of the window still redraws exactly
            assert series_at(kept, step, block_size) == series_at(run.residencies, step, block_size)


def test_example_scenario_ends_as_the_worked_example(small_result):
    ex = small_result.example
    example = replay_document(small_result)["scenarios"][0]
    assert example["id"] == "example" and example["frames"] == list(range(max(ex.lengths)))
    end = {m["allocator"]: {n: values[-1] for n, values in m["series"].items()} for m in example["memories"]}
    assert end["max"]["held"] == ex.naive_slots and end["paged"]["held"] == ex.paged_slots
    assert end["oracle"]["held"] == sum(ex.lengths)
    assert all(end[a]["stored"] == sum(ex.lengths) for a in REPLAY_ALLOCATORS)
    paged = example["memories"][-1]
    assert [r.placement for r in decoded(paged)] == list(ex.block_ids)
    assert paged["num_blocks"] == sum(map(len, ex.block_ids))


def test_page_is_one_self_contained_file(small_result):
    html = render_replay(small_result)
    assert html.count("<script") == 2 and "</script>" in html
    data = html.split('<script type="application/json" id="replay-data">')[1].split("</script>")[0]
    assert json.loads(data) == replay_document(small_result)
    assert "http://" not in html and "https://" not in html and " src=" not in html
    assert "@DATA@" not in html and "/*@SCRIPT@*/" not in html
