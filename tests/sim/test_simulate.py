"""The whole simulation: the JSON document's fields, reproducibility, validation, plots."""

import json

import pytest
from matplotlib.image import imread

from pagedkv.sim import SimConfig, simulate
from pagedkv.sim.plots import write_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result():
    return simulate(SimConfig())


def test_json_document_has_the_design_fields(result):
    doc = json.loads(json.dumps(result.to_json()))  # serialisable as it is
    assert doc["kv_bytes_per_token"] == 524288  # 2 x 32 layers x 32 heads x 128 dims x 2 bytes
    assert doc["example"]["paged_slots"] == 96 and doc["example"]["naive_slots"] == 6144
    assert doc["example"]["ratio"] == 64
    assert [row["batch_size"] for row in doc["batches"]] == [10, 25, 50, 100, 150, 200]
    for row in doc["batches"]:
        for name in ("naive", "pow2", "oracle", "paged"):
            stats = row[name]
            assert stats["used_bytes"] <= stats["reserved_bytes"]
            assert stats["utilization"] == pytest.approx(stats["used_bytes"] / stats["reserved_bytes"])
            assert set(stats["waste_bytes"]) == {
                "reservation",
                "internal_fragmentation",
                "external_fragmentation",
            }
        assert row["paged"]["utilization"] >= 0.98
        assert 0.20 <= row["naive"]["utilization"] <= 0.30
    assert [row["block_size"] for row in doc["block_sizes"]] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert all({"wasted_slots", "wasted_bytes", "table_entries"} <= set(row) for row in doc["block_sizes"])
    sharing = doc["prefix_sharing"]
    assert sharing["bytes_with_sharing"] < sharing["bytes_without_sharing"]
    assert sharing["cow_copies"] == sharing["num_requests"] - 1  # 600 % 16 != 0: a partial block
    cap = doc["capacity"]
    assert cap["naive_requests"] == 61 and cap["ratio"] >= 3
    assert cap["ratio"] == cap["paged_requests"] / cap["naive_requests"]
    trace = doc["trace"]["allocators"]
    assert set(trace) == {"naive", "pow2", "oracle", "paged"}
    assert trace["paged"]["peak_running"] >= 200
    assert trace["paged"]["completed"] > trace["oracle"]["completed"] > trace["naive"]["completed"]


def test_same_seed_same_document_other_seed_other_document(result):
    again = simulate(SimConfig())
    assert json.dumps(again.to_json()) == json.dumps(result.to_json())
    other = simulate(SimConfig(seed=1, batch_sizes=(10,), sweep_batch_size=10, trace_steps=500))
    assert other.to_json()["batches"][0] != result.to_json()["batches"][0]


@pytest.mark.parametrize("workload", ["sharegpt", "shared-prefix"])
def test_other_workloads_keep_the_ordering(workload):
    small = simulate(SimConfig(workload=workload, batch_sizes=(50,), sweep_batch_size=50, trace_steps=1500))
    b = small.snapshots[0].breakdowns
    assert b["max"].utilization < b["oracle"].utilization < b["paged"].utilization
    assert b["paged"].utilization >= 0.98
    assert small.capacity["paged"] > small.capacity["max"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_memory": 10**9, "weights_memory": 2 * 10**9}, "no memory left"),
        ({"gpu_memory": 14 * 2**30, "max_seq_len": 4096}, "fewer than one"),
        ({"block_size": 0}, "block_size"),
        ({"seed": -3}, "seed"),
        ({"batch_sizes": ()}, "batch_sizes"),
        ({"workload": "chat"}, "unknown workload"),
        ({"max_seq_len": 512, "prefix_len": 600}, "prefix_len"),
    ],
)
def test_bad_configurations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**kwargs)


def test_default_prefix_fits_short_contexts():
    assert SimConfig().system_prompt_len == 600
    assert SimConfig(max_seq_len=512).system_prompt_len == 256


def test_plots_are_valid_pngs(result, tmp_path):
    paths = write_plots(result, tmp_path / "plots")
    names = {p.name for p in paths}
    assert {
        "utilization_vs_batch.png",
        "waste_breakdown.png",
        "block_size_tradeoff.png",
        "memory_map.png",
    } <= names
    for path in paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 500
        assert image.std() > 0.05  # not a blank canvas
