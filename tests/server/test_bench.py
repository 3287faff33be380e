"""``pagedkv bench serve`` (pagedkv/bench/serve.py) against the test server: a short seeded run, its
figures consistent. It lives with the server tests, whose fixtures start the server."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from pagedkv.bench.commands import SERVE
from pagedkv.bench.driver import add_bench
from pagedkv.bench.serve import ServeConfig, make_workload, print_report, run_benchmark
from pagedkv.models import BUILTIN_NOTE
from tests.server.helpers import API_KEY, wait_idle


def test_workload_is_seeded():
    config = ServeConfig(num_prompts=5, input_len=10, output_len=8, range_ratio=0.5, seed=3)
    assert make_workload(config) == make_workload(config)
    assert make_workload(config) != make_workload(ServeConfig(num_prompts=5, input_len=10, seed=4))
    lengths = [len(item.prompt.split()) for item in make_workload(config)]
    assert all(5 <= n <= 15 for n in lengths)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_prompts=0), "num_prompts"),
        (dict(request_rate=0), "request_rate"),
        (dict(range_ratio=1.0), "range_ratio"),
        (dict(max_concurrency=0), "max_concurrency"),
    ],
)
def test_bad_bench_config_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**options)


def test_poisson_run_against_the_server(base_url, capsys):
    config = ServeConfig(
        num_prompts=8, request_rate=40.0, input_len=12, output_len=6, seed=1, api_key=API_KEY
    )
    result = run_benchmark(base_url, config)
    assert (result.completed, result.failed) == (8, 0)
    assert result.total_output_tokens == 8 * 6  # ignore_eos: every request runs to its length
    assert result.output_throughput == pytest.approx(result.total_output_tokens / result.duration_s)
    for stats in (result.ttft_ms, result.itl_ms, result.e2e_ms):
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert result.ttft_ms["p99"] <= result.e2e_ms["p99"]
    assert 0 < result.peak_kv_usage <= 1
    print_report(result)
    out = capsys.readouterr().out
    assert "Output token throughput" in out and "Inter-token latency" in out
    wait_idle(base_url)


def test_bench_serve_command_prints_json(base_url, capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers(), SERVE)
    args = parser.parse_args(
        [
            "serve",
            "--base-url",
            base_url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "4",
            "--output-len",
            "4",
            "--json",
            "--out",
            str(tmp_path),
        ]
    )
    assert math.isinf(args.request_rate)
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 4 and report["total_output_tokens"] == 16
    assert report["config"]["request_rate"] == "inf" and "api_key" not in report["config"]
    assert json.loads((tmp_path / "serve.json").read_text()) == report


def test_bench_serve_reports_failures_with_a_nonzero_status(base_url, capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers(), SERVE)
    args = parser.parse_args(
        [
            "serve",
            "--base-url",
            base_url,
            "--api-key",
            "wrong",
            "--served-model-name",
            "x",
            "--num-prompts",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.func(args) == 1
    assert "HTTP 401" in capsys.readouterr().out


def test_bench_serve_starts_its_own_server_without_a_base_url(capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers(), SERVE)
    options = ["--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--num-kv-blocks", "32"]
    args = parser.parse_args(["serve", *options, "--max-model-len", "128", "--json", "--out", str(tmp_path)])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["model"] == "pagedkv-builtin" and report["completed"] == 3
    assert BUILTIN_NOTE in captured.err
