"""``pagedkv bench serve --vllm-python``: the server each side runs in, and how the two are compared.

vLLM itself is not installed for the tests (it pins its own torch and takes a GiB); the part that
runs a server process and measures it is exercised on a real ``pagedkv serve`` process instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
from pathlib import Path

import pytest

from pagedkv.bench.commands import SERVE
from pagedkv.bench.driver import add_bench
from pagedkv.bench.serve import ServeConfig, run_benchmark
from pagedkv.bench.serve_servers import (
    ServedModel,
    comparison_rows,
    pagedkv_command,
    running_server,
    vllm_command,
    vllm_environment,
    warm_up,
)
from pagedkv.models.builtin import builtin_model_path
from pagedkv.server.replicas import free_port


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple:
    """A short run against a real `pagedkv serve` process started as the comparison starts it."""
    served = ServedModel(str(builtin_model_path()), "float32", max_num_seqs=8, threads=1)
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "pagedkv-server.log"
    config = ServeConfig(num_prompts=4, input_len=8, output_len=5, seed=2)
    with running_server(pagedkv_command(served, port), {"OMP_NUM_THREADS": "1"}, port, log, "pagedkv") as url:
        assert _listening(port)
        run_benchmark(url, warm_up(config))
        result = run_benchmark(url, config)
    return result, port, log


def test_the_server_process_serves_the_workload_and_is_stopped_after(measured):
    result, port, log = measured
    assert (result.completed, result.failed) == (4, 0)
    assert result.total_output_tokens == 4 * 5
    assert not _listening(port)  # terminated on leaving the block
    assert Path(log).exists()


def test_a_server_that_dies_before_it_is_healthy_is_reported(tmp_path):
    command = ["python3", "-c", "raise SystemExit(3)", "--port", "1"]
    with pytest.raises(RuntimeError, match="exited with status 3"):
        with running_server(command, {}, free_port(), tmp_path / "dead.log", "dead server"):
            pass


def _better_by(ours, theirs) -> dict:
    rows = comparison_rows({"pagedkv": ours, "vllm": theirs})
    return {row["metric"]: row["pagedkv_better_by"] for row in rows}


def test_ratios_say_how_much_better_pagedkv_is(measured):
    result = measured[0]
    same = {
        row["metric"]: row["pagedkv_better_by"]
        for row in comparison_rows({"pagedkv": result, "vllm": result})
    }
    assert same["output tokens/s"] == pytest.approx(1.0) and same["ITL p50 (ms)"] == pytest.approx(1.0)
    slower = dataclasses.replace(
        result,
        output_throughput=result.output_throughput / 2,
        itl_ms={key: value * 2 for key, value in result.itl_ms.items()},
    )
    rows = {
        row["metric"]: row["pagedkv_better_by"]
        for row in comparison_rows({"pagedkv": result, "vllm": slower})
    }
    assert rows["output tokens/s"] == pytest.approx(2.0)  # twice the throughput
    assert rows["ITL p50 (ms)"] == pytest.approx(2.0)  # half the latency
    assert rows["failed requests"] is None  # 0 failures on both sides: no ratio


def test_both_servers_get_the_same_model_dtype_limits_and_threads():
    served = ServedModel("/models/m", "bfloat16", max_num_seqs=48, threads=2, vllm_kv_cache_gib=3)
    ours, theirs = pagedkv_command(served, 8001), vllm_command(served, "/venv/bin/python", 8002)
    for command in (ours, theirs):
        assert command[command.index("--model") + 1] == "/models/m"
        assert command[command.index("--dtype") + 1] == "bfloat16"
        assert command[command.index("--max-num-seqs") + 1] == "48"
    assert "--no-prefix-caching" in ours and "--no-enable-prefix-caching" in theirs
    assert "--no-enable-chunked-prefill" in theirs  # its CPU build fails seeded chunked prompts
    assert "--kv-cache-memory" not in ours  # pagedkv's default pool, as a user gets it
    assert vllm_environment(served) == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    sized = pagedkv_command(dataclasses.replace(served, kv_cache_memory="3GiB"), 8001)
    assert sized[sized.index("--kv-cache-memory") + 1] == "3GiB"


def test_vllm_mode_needs_a_model_folder(capsys):
    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers(), SERVE)
    args = parser.parse_args(["serve", "--vllm-python", "/venv/bin/python"])
    with pytest.raises(SystemExit) as exit_info:
        args.func(args)
    assert exit_info.value.code == 2
    assert "--vllm-python needs --model" in capsys.readouterr().err
