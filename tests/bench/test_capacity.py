"""``pagedkv bench capacity`` at 1/8 scale: paged serves far more requests at once in the same
budget, keeps its blocks full, and every policy hands every block back."""

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest
from rich.console import Console

from pagedkv.bench.capacity import (
    CapacityConfig,
    CapacityResult,
    PolicyRun,
    StepSample,
    demo_config,
    least_clocks,
    length_biased_prediction,
    run_capacity,
)
from pagedkv.bench.capacity_report import TIMED, capacity_claims
from pagedkv.bench.commands import CAPACITY
from pagedkv.bench.driver import EngineOptions, MeasuredEngine, add_bench, run_section
from pagedkv.engine import SamplingParams
from pagedkv.engine.core.kv_policy import KV_POLICIES, PAGED
from pagedkv.sim.workloads import Workload


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("capacity")
    console = Console(record=True, width=160)
    result, plots = run_section(CAPACITY, demo_config(seed=0), console, out)
    return result, console.export_text(), out, plots


def test_paged_runs_far_more_requests_at_once(demo):
    result, _, _, _ = demo
    config = result.config
    paged, contiguous, oracle = (result.runs[p.name].figures for p in KV_POLICIES)
    assert contiguous["peak_running"] == config.kv_tokens // config.max_model_len
    assert paged["peak_running"] >= 2 * contiguous["peak_running"]
    assert paged["mean_running_full"] >= 2 * contiguous["mean_running_full"]
    assert contiguous["peak_running"] < oracle["peak_running"] < paged["peak_running"]


def test_paged_keeps_decode_headroom_and_throws_no_work_away(demo):
    """Admission leaves room for the running requests' growth: under 5 % of the computed tokens
    are recomputed after preemption (counted, not timed), and paged still runs more requests at
    once than the contiguous oracle."""
    result, text, _, _ = demo
    paged = result.runs["paged"]
    assert paged.computed_tokens >= sum(len(p) + m - 1 for p, m in result.config.requests(2048))
    assert paged.figures["recomputed_share"] < 0.05
    assert paged.figures["mean_running_full"] > result.runs["contiguous-oracle"].figures["mean_running_full"]
    assert "paged recomputes < 5% of computed tokens" in text


def test_the_demo_meets_every_claim_it_makes(demo):
    """Every claim is judged on counts, so it holds on any host, and by wide margins: paged
    leaves a sliver of its slots empty where contiguous leaves most of them, and finishes the
    batch in under half the steps."""
    result, _, _, _ = demo
    claims = capacity_claims(result)
    assert [c.claim for c in claims if c.holds is not True] == []
    assert "throughput" not in " ".join(c.claim for c in claims)
    paged, contiguous = result.runs["paged"].figures, result.runs["contiguous"].figures
    assert contiguous["empty_share_full"] > 0.5 > 0.01 > paged["empty_share_full"]
    assert 2 * paged["steps"] < contiguous["steps"]


def test_counted_figures_do_not_depend_on_the_clock_or_the_threads():
    """The claims' figures come from a schedule decided on token and block counts alone: the
    demo's workload (a quarter of its requests and budget, so the test stays short) run on one thread with
    repeats and on two without counts the same (its times differ)."""
    config = dataclasses.replace(demo_config(seed=0), num_requests=16, kv_tokens=2 * 2048, repeats=2)
    engine = dataclasses.replace(config.engine, threads=2)
    once, again = run_capacity(config), run_capacity(dataclasses.replace(config, engine=engine, repeats=1))
    timed = {row.figure for row in TIMED}
    for name, run in once.runs.items():
        counted = {k: v for k, v in run.figures.items() if k not in timed}
        assert not any(math.isnan(v) for v in counted.values())  # the batch fills the budget
        assert {k: v for k, v in again.runs[name].figures.items() if k not in timed} == counted
    assert [(c.claim, c.figures, c.holds) for c in capacity_claims(again)] == [
        (c.claim, c.figures, c.holds) for c in capacity_claims(once)
    ]


def test_a_batch_that_never_fills_the_budget_judges_no_concurrency_claim():
    run = _run([_sample(3, 2, False), _sample(5, 0, False)])
    result = CapacityResult(
        CapacityConfig(), dict.fromkeys(("paged", "contiguous", "contiguous-oracle"), run), {}, {}
    )
    holds = {c.claim: c.holds for c in capacity_claims(result)}
    assert holds["requests at once (mean once full): paged >= 2x contig."] is None
    assert holds["requests at once (peak): paged >= 2x contig."] is False  # 5 vs 5: judged, and fails


def test_every_policy_runs_without_a_prefix_cache():
    """Only the KV policy differs between the runs: the contiguous ones cannot have a prefix
    cache, so the paged one runs without it too, whatever the engine options say."""
    config = CapacityConfig(engine=EngineOptions(enable_prefix_caching=True, scale=8))
    assert [config.engine_config(policy).enable_prefix_caching for policy in KV_POLICIES] == [False] * 3


def test_paged_keeps_its_blocks_full_and_contiguous_does_not(demo):
    result, _, _, _ = demo
    assert result.runs["paged"].figures["utilization_full"] >= 0.95
    assert result.runs["contiguous"].figures["utilization_full"] < 0.5


def test_every_policy_serves_everything_and_returns_every_block(demo):
    result, _, _, _ = demo
    requests = result.config.requests(2048)
    expected_tokens = sum(max_tokens for _, max_tokens in requests)
    for run in result.runs.values():
        assert run.blocks_returned, run.policy
        assert run.generated_tokens == expected_tokens
        assert len(run.ttft) == len(requests)
        figures = run.figures
        assert 0 < figures["ttft_mean_s"] <= figures["ttft_p99_s"] <= figures["wall_s"]
        assert (run.preemptions > 0) == (run.recomputed_tokens > 0)


def test_report_and_plots(demo):
    result, text, out, plots = demo
    blocks = result.config.num_kv_blocks
    for needle in ("paged/contig.", "predicted vs live engine", f"all back: the pool has {blocks:,}"):
        assert needle in text
    assert text.count("  met  ") == len(capacity_claims(result)) and "NOT met" not in text
    assert sorted(p.name for p in out.iterdir()) == [
        "capacity.json",
        "capacity_concurrency.png",
        "capacity_utilization.png",
    ]
    assert all(p.stat().st_size > 10_000 for p in plots) and len(plots) == 2
    assert result.predicted["contiguous"] == result.config.kv_tokens // result.config.max_model_len
    assert result.predicted["paged"] > 2 * result.predicted["contiguous"]
    assert result.length_biased["contiguous"] == result.config.kv_tokens // result.config.max_model_len


def _sample(running: int, waiting: int, blocked: bool, stored: int = 30) -> StepSample:
    return StepSample(0.0, running, waiting, used_blocks=4, stored_tokens=stored, memory_blocked=blocked)


def _run(samples: list[StepSample]) -> PolicyRun:
    return PolicyRun("paged", 8, 16, samples, [1.0], 10, 0, 0, 100, 0, 0)


def test_full_window_runs_from_memory_blocked_until_nothing_waits():
    samples = [
        _sample(2, 5, False),
        _sample(4, 3, True, stored=32),
        _sample(4, 3, False, stored=16),
        _sample(5, 0, False),
        _sample(5, 1, True),
    ]
    run = _run(samples)
    assert run.full_window == samples[1:3]
    assert run.figures["mean_running_full"] == 4
    assert run.figures["utilization_full"] == pytest.approx((1.0 + 0.5) / 2)
    assert run.figures["peak_running"] == 5


def test_a_batch_that_never_fills_memory_has_no_full_window():
    run = _run([_sample(3, 2, False), _sample(5, 0, False)])
    assert run.full_window == []
    assert math.isnan(run.figures["mean_running_full"])
    assert run.figures["mean_running"] == 4


def test_length_biased_prediction_weights_each_request_by_its_output():
    config = CapacityConfig(kv_tokens=4096, max_model_len=2048, engine=EngineOptions(block_size=16))
    # 16 + (0, 1) tokens hold 1, 2 blocks; 32 + (0..5) hold 2, 3, 3, 3, 3, 3: 20 blocks over 8 steps
    predicted = length_biased_prediction(config, [([0] * 16, 2), ([0] * 32, 6)])
    assert predicted["paged"] == pytest.approx(4096 / (20 * 16 / 8))
    # the oracle holds 2 and 3 blocks for 2 and 6 steps
    assert predicted["contiguous-oracle"] == pytest.approx(4096 / ((2 * 2 + 6 * 3) * 16 / 8))
    assert predicted["contiguous"] == 2


def _measured_run(config: CapacityConfig, requests) -> MeasuredEngine:
    measured = MeasuredEngine.start(config.engine_config(PAGED), prime=False)
    for i, (prompt, max_tokens) in enumerate(requests):
        measured.submit(
            f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
    measured.drain()
    return measured


def test_repeats_time_each_step_by_its_fastest_run_of_the_same_schedule():
    config = CapacityConfig(num_requests=6, kv_tokens=4096, engine=EngineOptions(scale=16))
    requests = config.requests(2048)
    runs = [_measured_run(config, requests) for _ in range(2)]
    clocks = least_clocks(PAGED, runs)
    fastest = [min(a.step_time_s, b.step_time_s) for a, b in zip(runs[0].steps, runs[1].steps, strict=True)]
    assert clocks == pytest.approx(np.cumsum(fastest).tolist())
    assert clocks[-1] <= min(run.clock for run in runs)
    other = _measured_run(config, requests[1:])  # another workload: another schedule
    with pytest.raises(RuntimeError, match="scheduled the same requests differently"):
        least_clocks(PAGED, [runs[0], other])


def test_every_engine_policy_runs_in_table_order(demo):
    result, _, _, _ = demo
    assert list(result.runs) == [p.name for p in KV_POLICIES] == ["paged", "contiguous", "contiguous-oracle"]


def test_requests_are_the_simulators_lengths_divided_by_scale():
    lengths = Workload("sharegpt", 2048).sample(np.random.default_rng(7), 20)
    full = CapacityConfig(workload="sharegpt", num_requests=20, seed=7).requests(2048)
    assert [(len(p), m) for p, m in full] == [(r.prompt_len, r.output_len) for r in lengths]
    scaled = CapacityConfig(workload="sharegpt", num_requests=20, seed=7, engine=EngineOptions(scale=8))
    scaled = scaled.requests(2048)
    assert all(len(p) + m <= 256 for p, m in scaled)
    assert [len(p) for p, _ in scaled] == [max(1, r.prompt_len // 8) for r in lengths]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_tokens": 1024}, "cannot hold even one contiguous reservation"),
        ({"engine": EngineOptions(scale=3)}, "scale 3 must divide max_model_len"),
        ({"workload": "shared-prefix"}, "workload must be one of"),
        ({"num_requests": 0}, "num_requests must be a positive integer, got 0"),
        ({"kv_tokens": 4100}, "whole number of 16-token blocks"),
        ({"repeats": 0}, "repeats must be a positive integer, got 0"),
    ],
)
def test_bad_configs_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        CapacityConfig(**options)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv bench")
    add_bench(parser.add_subparsers(dest="bench", required=True), CAPACITY)
    return parser


def test_cli_prints_json_and_writes_plots(tmp_path, capsys):
    args = _parser().parse_args(
        [
            "capacity",
            "--scale",
            "16",
            "--num-requests",
            "12",
            "--kv-tokens",
            "4096",
            "--threads",
            "1",
            "--repeats",
            "2",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    assert args.run(args) == 0
    document = json.loads(capsys.readouterr().out)
    assert set(document["policies"]) == {"paged", "contiguous", "contiguous-oracle"}
    assert document["engine"] == {"max_model_len": 128, "block_size": 1, "num_kv_blocks": 256}
    assert document["policies"]["contiguous"]["peak_running"] == 2
    assert document["config"]["repeats"] == 2
    assert all(p["blocks_returned"] for p in document["policies"].values())
    assert len(document["plots"]) == 2 and all(
        (tmp_path / p.split("/")[-1]).exists() for p in document["plots"]
    )


def test_cli_rejects_a_bad_budget(capsys):
    args = _parser().parse_args(["capacity", "--kv-tokens", "100"])
    with pytest.raises(SystemExit) as exit_info:
        args.run(args)
    assert exit_info.value.code == 2
    assert "cannot hold even one contiguous reservation" in capsys.readouterr().err
