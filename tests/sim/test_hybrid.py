"""Experiment (g): a windowed model paged by KV group (the real hybrid manager) holds more
requests than whole-context allocation in the same memory, and the report and plot show both
groups."""

import json

import numpy as np
import pytest
from rich.console import Console

from pagedkv.memory import blocks_for
from pagedkv.sim import SimConfig, simulate
from pagedkv.sim.hybrid import expand_layer_windows, hybrid_capacity
from pagedkv.sim.plots import write_plots
from pagedkv.sim.report import print_report
from pagedkv.sim.workloads import Workload

WINDOW = 256


def test_sliding_groups_hold_a_window_and_free_the_rest():
    workload = Workload("normal", max_seq_len=2048)
    result = hybrid_capacity(workload, 64 * 1024, 16, (WINDOW, None), 128, np.random.default_rng(0))
    assert result.block_layers == {"hybrid": 1, "whole": 2}
    assert result.pool_blocks == {"hybrid": 2 * 4096 - 1, "whole": 4096}
    full, sliding = result.groups
    assert (full.window, sliding.window) == (None, WINDOW)
    held = result.requests["hybrid"]
    # every live request's sliding table: the window's blocks and the one a boundary adds, at most
    assert sliding.held_blocks <= held * (blocks_for(WINDOW, 16) + 1) < full.held_blocks
    assert sliding.expired_blocks > 0 and full.expired_blocks == 0
    assert result.used_blocks["hybrid"] == full.held_blocks + sliding.held_blocks  # nothing shared
    # whole context: the pool was full; hybrid paging: ~750-token requests, a 256-token window
    assert result.used_blocks["whole"] > 0.95 * result.pool_blocks["whole"]
    assert 1.3 < result.ratio < 2


def test_the_simulation_reports_both_groups(tmp_path):
    config = SimConfig(
        layer_windows=(WINDOW, None),
        batch_sizes=(10,),
        sweep_batch_size=10,
        trace_steps=200,
        prefill_chunk=512,
    )
    result = simulate(config)
    doc = json.loads(json.dumps(result.to_json()))["hybrid"]
    assert doc["layer_windows"] == [WINDOW, None] * 16  # the pattern over the 32 layers
    assert [g["window"] for g in doc["groups"]] == [None, WINDOW] and doc["ratio"] > 1.3
    console = Console(record=True, width=200)
    print_report(result, console)
    text = console.export_text()
    assert "(g) Sliding windows" in text and "handed back as the window passed" in text
    assert f"{doc['ratio']:.2f}x" in text
    paths = write_plots(result, tmp_path)
    assert tmp_path / "kv_groups.png" in paths and (tmp_path / "kv_groups.png").stat().st_size > 0


def test_a_pattern_must_repeat_over_the_layers():
    assert expand_layer_windows((4, None), 4) == (4, None, 4, None)
    with pytest.raises(ValueError, match="does not repeat over 32 layers"):
        SimConfig(layer_windows=(4, None, None))
    assert simulate(SimConfig(batch_sizes=(10,), sweep_batch_size=10, trace_steps=100)).hybrid is None
