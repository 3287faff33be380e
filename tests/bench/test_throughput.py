"""``pagedkv bench throughput`` at a tiny scale: seeded workloads every engine shares, pagedkv and
transformers end to end with their tokens compared, rivals whose Python is wrong reported as
"not run" with the reason, and the roofline arithmetic."""

import json
import os
import sys
import time

import pytest
import torch

from pagedkv.bench.bench_model import BENCH_MODEL_CONFIG, MODEL_SHAPES, word_tokenizer
from pagedkv.bench.host import PROBE_ELEMENTS, LoadMeter, memory_read_gbs, parallel_speedup
from pagedkv.bench.throughput import (
    FIRST_PROMPT_ID,
    STATISTICS,
    ThroughputConfig,
    Workload,
    WorkloadShape,
    build_workload,
    build_workloads,
)
from pagedkv.bench.throughput_floor import (
    decode_figure,
    floor_seconds,
    kv_bytes_per_token,
    measure_copy_rate,
    weight_bytes,
)
from pagedkv.bench.throughput_gemm import GemmRates, GemmTiming, linear_shapes, measure_gemm, roofline_seconds
from pagedkv.bench.throughput_report import Measurement
from pagedkv.cli import main
from tests.checkpoints import hf_config, make_checkpoint


# -- workloads -----------------------------------------------------------------------------------
def test_workloads_are_seeded_and_sent_to_every_engine_unchanged():
    shape = WorkloadShape(num_requests=8, prompt_len=32, max_tokens=16, seed=3)
    first = build_workloads(("mixed", "uniform", "single"), shape, 1000)
    again = build_workloads(("single", "uniform", "mixed"), shape, 1000)
    assert [w.name for w in first] == ["mixed", "uniform", "single", "single-prefill"]
    assert first == again
    other = build_workloads(("mixed",), WorkloadShape(8, 32, 16, seed=4), 1000)
    assert other[0].prompts != first[0].prompts
    for workload in first:  # what a rival worker receives is exactly what pagedkv runs
        sent = json.loads(json.dumps(workload.to_json()))
        assert (
            Workload(sent["name"], tuple(map(tuple, sent["prompts"])), tuple(sent["max_tokens"])) == workload
        )


def test_workload_shapes():
    shape = WorkloadShape(num_requests=32, prompt_len=128, max_tokens=128)
    mixed = build_workload("mixed", shape, 32000)
    assert mixed.num_requests == 32
    assert all(16 <= len(p) <= 256 for p in mixed.prompts) and all(16 <= m <= 256 for m in mixed.max_tokens)
    assert len({len(p) for p in mixed.prompts}) > 8 and len(set(mixed.max_tokens)) > 8
    assert all(FIRST_PROMPT_ID <= t < 32000 for p in mixed.prompts for t in p)
    uniform = build_workload("uniform", shape, 32000)
    assert {len(p) for p in uniform.prompts} == {128} and set(uniform.max_tokens) == {128}
    single = build_workload("single", shape, 32000)
    assert single.prompts == uniform.prompts[:1] and single.generated_tokens == 128
    assert uniform.decode_batch_sizes() == [32] * 127
    assert Workload("w", ((5,), (6,)), (3, 1)).decode_batch_sizes() == [1, 1]
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("bursty", shape, 32000)
    with pytest.raises(ValueError, match="positive"):
        WorkloadShape(num_requests=0)


def test_the_bench_models_tokenizer_covers_its_vocabulary():
    tokenizer = word_tokenizer(BENCH_MODEL_CONFIG["vocab_size"])
    assert tokenizer.get_vocab_size() == 32000
    assert tokenizer.decode([31999, 7]) == "w31999 w7"


# -- end to end ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """pagedkv and transformers on a tiny Llama; vLLM given a Python that does not exist and
    llama.cpp one without llama_cpp (this test's own), so both must say why they did not run."""
    tmp = tmp_path_factory.mktemp("throughput")
    model = make_checkpoint(tmp, "llama")
    argv = [
        "bench", "throughput", "--model", str(model), "--dtypes", "float32", "--workloads", "uniform",
        "single", "--num-requests", "3", "--prompt-len", "8", "--max-tokens", "6", "--repeats", "2",
        "--no-gemm", "--out", str(tmp / "out"), "--vllm-python", str(tmp / "no-such-venv" / "python"),
        "--llamacpp-python", sys.executable, "--json",
    ]  # fmt: skip
    return argv, tmp


def test_pagedkv_and_transformers_run_end_to_end_and_agree(tiny_run, capsys):
    argv, _ = tiny_run
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    status = out["engines"]["float32"]
    assert status["pagedkv"]["state"] == status["transformers"]["state"] == "ok"
    runs = {(r["engine"], r["workload"]): r for r in out["runs"]}
    for engine in ("pagedkv", "transformers"):
        assert runs[(engine, "uniform")]["generated_tokens"] == 18
        assert len(runs[(engine, "uniform")]["elapsed_s"]) == 2
        assert runs[(engine, "single-prefill")]["generated_tokens"] == 1
    rows = {(r["workload"], r["engine"]): r for r in out["agreement"]}
    for workload, requests in (("uniform", 3), ("single", 1)):
        row = rows[(workload, "pagedkv")]
        assert row["reference"] == "transformers"
        assert row["identical_requests"] == row["requests"] == requests
        assert row["tokens_before_first_difference"] == 1.0
    uniform = next(r for r in out["throughput"] if r["workload"] == "uniform")
    assert uniform["tokens_per_s"]["pagedkv"] > 0 and uniform["tokens_per_s"]["vllm"] is None
    assert uniform["pagedkv_over"]["transformers"] > 0
    assert {r["engine"] for r in out["latency"]} == {"pagedkv", "transformers"}
    assert out["gemm"] == {} and out["roofline"] == []
    assert 0.0 <= out["machine"]["other_cpu_share"] <= 1.0
    for end in ("start", "end"):  # the host's state, measured at both ends of the run (2 threads)
        assert 0.0 < out["machine"][f"memory_read_gbs_{end}"] < float("inf")
        assert 0.0 < out["machine"][f"parallel_speedup_{end}"] < float("inf")


def test_the_load_meter_does_not_count_this_process_as_other_work():
    meter = LoadMeter()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # 0.3 s of our own CPU
        pass
    load = meter.stop()
    assert load["cpus"] == os.cpu_count()
    busy_wall = time.perf_counter() - meter.wall
    # our own 0.3 CPU-seconds are not in the share: whatever is left is at most the rest
    assert 0.0 <= load["other_cpu_share"] <= 1.0 - 0.3 / (busy_wall * load["cpus"]) + 0.05


def test_the_memory_probe_reads_its_buffer_at_a_rate_that_its_own_timing_bounds():
    started = time.perf_counter()
    rate = memory_read_gbs(repeats=3)
    elapsed = time.perf_counter() - started
    # the fastest of three sums took at most a third of the whole call (which also filled the buffer)
    assert rate >= 3 * PROBE_ELEMENTS * 4 / elapsed / 1e9
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        memory_read_gbs(repeats=0)


def test_the_parallel_probe_restores_the_thread_count_and_needs_two_threads():
    before = torch.get_num_threads()
    assert parallel_speedup(1) is None  # nothing to compare one thread with
    assert parallel_speedup(2, repeats=1) > 0.0
    assert torch.get_num_threads() == before


def test_a_rival_with_a_wrong_python_is_reported_not_run(tiny_run, capsys, monkeypatch):
    argv, tmp = tiny_run
    monkeypatch.setenv("COLUMNS", "400")  # one reason per line, unwrapped
    assert main([a for a in argv if a != "--json"]) == 0
    text = capsys.readouterr().out
    assert "vLLM (float32): not run:" in text and "no such Python executable" in text
    assert "llama.cpp (float32): not run: llama_cpp is not importable by" in text
    assert "pass the python of the venv" in text
    assert "memory read rate, start -> end:" in text  # the host's state, printed under the tables
    assert "a small GEMM on 2 threads against one, start -> end:" in text
    log = (tmp / "out" / "logs" / "llamacpp-float32.log").read_text()
    assert "Traceback" not in log  # a clean refusal, not a crash


def test_bad_options_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--engines", "tensorrt"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--model", "/no/such/folder"])
    assert exc.value.code == 2
    assert "no config.json" in capsys.readouterr().err


# -- GEMM rate and roofline ----------------------------------------------------------------------
def test_roofline_adds_up_every_linear_of_every_step():
    config = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "num_hidden_layers": 3,
    }
    # 1 ms per row of every matrix: the roofline is then just rows x matrices.
    timings = [
        GemmTiming("float32", shape, m, k, n, "F.linear", float(m))
        for shape, (k, n) in linear_shapes(config).items()
        for m in (1, 4, 64)
    ]
    rates = GemmRates(timings)
    assert rates.best_ms("qkv", 2) == pytest.approx(2.0) and rates.best_ms("o", 128) == pytest.approx(128.0)
    workload = Workload("w", ((5,) * 40,) * 4, (10,) * 4)
    expected_ms = 3 * 4 * 160 + 4 + (3 * 4 + 1) * 4 * 9  # prefill rows, first tokens, 9 decode steps
    assert roofline_seconds(config, workload, rates, prefill_chunk=64) == pytest.approx(expected_ms / 1e3)


def test_gemm_rates_are_measured_for_every_kernel_at_the_needed_sizes():
    config = make_config_for_gemm()
    workload = Workload("w", ((5,) * 8,) * 3, (4,) * 3)
    rates = measure_gemm(config, torch.float32, [workload], prefill_chunk=2048, budget_s=0.0005)
    sizes = {(t.shape, t.m) for t in rates.timings}
    assert ("lm_head", 3) in sizes and ("gate_up", 24) in sizes and ("lm_head", 24) not in sizes
    assert {t.kernel for t in rates.timings} == {"F.linear", "oneDNN packed", "pagedkv tiled"}
    assert all(t.ms is None or (t.ms > 0 and t.gflops > 0) for t in rates.timings)
    assert all(t.ms is not None for t in rates.timings if t.kernel == "pagedkv tiled")  # float32 here
    assert roofline_seconds(config, workload, rates, 2048) > 0


def make_config_for_gemm() -> dict:
    return {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 64,
        "num_hidden_layers": 1,
    }


def test_median_or_best_of_the_repeats():
    runs = {
        stat: Measurement("pagedkv", "float32", "uniform", 100, stat, [2.0, 1.0, 4.0]) for stat in STATISTICS
    }
    assert runs["median"].tokens_per_s == 50.0 and runs["best"].tokens_per_s == 100.0
    assert runs["best"].to_json()["median_s"] == 2.0 and runs["median"].to_json()["best_s"] == 1.0
    with pytest.raises(ValueError, match="statistic"):
        ThroughputConfig(statistic="mean")


# -- decode steps against the bandwidth floor ----------------------------------------------------
def test_weight_bytes_are_the_published_parameter_counts_less_an_untied_embedding():
    """Llama-3.2-1B has 1,235,814,400 parameters, its LM head tied to the embedding: a decode step
    reads them all once. Llama-3.1-8B has 8,030,261,248, of which its untied embedding's
    128256 x 4096 are read only at the batch's rows."""
    assert weight_bytes(MODEL_SHAPES["llama-3.2-1b"], "bfloat16") == 2 * 1_235_814_400
    assert weight_bytes(MODEL_SHAPES["llama-3.1-8b"], "bfloat16") == 2 * (8_030_261_248 - 128256 * 4096)
    assert weight_bytes(MODEL_SHAPES["llama-3.2-1b"], "float32") == 4 * 1_235_814_400
    assert kv_bytes_per_token(MODEL_SHAPES["llama-3.2-1b"], "bfloat16") == 16 * 2 * 8 * 64 * 2


def test_the_floor_reads_the_weights_and_each_steps_mean_context_at_the_copy_rate():
    config = MODEL_SHAPES["llama-3.2-1b"]
    one = floor_seconds(config, "bfloat16", 1, 128, 128, copy_rate_gbs=4000.0)
    many = floor_seconds(config, "bfloat16", 64, 128, 128, copy_rate_gbs=4000.0)
    per_token = kv_bytes_per_token(config, "bfloat16")
    assert one == pytest.approx((2 * 1_235_814_400 + 192 * per_token) / 4e12)
    assert many - one == pytest.approx(63 * 192 * per_token / 4e12)
    figure = decode_figure("pagedkv", "bfloat16", 64, full_s=1.2, first_s=0.2, steps=100, floor_s=0.005)
    assert figure.step_ms == pytest.approx(10.0) and figure.tokens_per_s == pytest.approx(6400.0)
    assert figure.floor_share == pytest.approx(0.5)
    assert decode_figure("pagedkv", "bfloat16", 1, 0.1, 0.2, 10, 0.001).step_ms is None  # noise: no figure


def test_the_copy_rate_counts_reads_and_writes_of_a_timed_copy():
    started = time.perf_counter()
    rate = measure_copy_rate("cpu", repeats=2)
    elapsed = time.perf_counter() - started
    assert rate >= 2 * (1 << 28) / elapsed / 1e9  # the fastest of three copies took at most all of it


def test_the_device_chooses_the_default_engines_and_decode_batches(tmp_path):
    cpu, cuda = ThroughputConfig(), ThroughputConfig(device="cuda")
    assert "pagedkv-eager" not in cpu.engines and cpu.decode_batches == ()
    assert "pagedkv-eager" in cuda.engines and cuda.decode_batches == (1, 64)
    assert ThroughputConfig(model_shape="llama-3.1-8b").load_format == "dummy"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="give one"):
        ThroughputConfig(model=str(tmp_path), model_shape="llama-3.2-1b")


def test_decode_steps_of_a_dummy_model_run_on_the_cpu_with_graphs_on_and_off_and_agree_with_transformers(
    tmp_path, capsys
):
    """The CUDA bench's path on the CPU: a folder with only config.json, the weights drawn by
    name (the same in pagedkv and transformers: their float32 tokens agree), decode steps at
    two batch sizes timed against the floor, pagedkv with and without graphs."""
    folder = tmp_path / "shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config("llama").to_dict()))
    argv = [
        "bench", "throughput", "--device", "cpu", "--model", str(folder), "--load-format", "dummy",
        "--engines", "pagedkv", "pagedkv-eager", "transformers", "--dtypes", "float32", "--workloads",
        "single", "--decode-batches", "1", "3", "--prompt-len", "8", "--max-tokens", "6", "--repeats", "1",
        "--out", str(tmp_path / "out"), "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["copy_rate_gbs"] > 0
    figures = {(f["engine"], f["batch"]): f for f in out["decode"]}
    assert set(figures) == {(e, b) for e in ("pagedkv", "pagedkv-eager", "transformers") for b in (1, 3)}
    for figure in figures.values():
        assert figure["floor_ms"] > 0 and (figure["step_ms"] is None or figure["step_ms"] > 0)
    agreement = {(r["workload"], r["engine"]): r for r in out["agreement"]}
    for engine in ("pagedkv", "pagedkv-eager"):
        row = agreement[("decode-3", engine)]
        assert row["reference"] == "transformers" and row["identical_requests"] == row["requests"] == 3
    assert {r["workload"] for r in out["throughput"]} == {"single", "decode-1", "decode-3"}
