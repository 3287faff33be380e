"""``pagedkv bench throughput``: every engine, workload and dtype in one run.

For each dtype the engines are loaded once, then take turns: repetition by repetition, workload
by workload, each engine runs the same ids. On a machine shared with other work a burst of
background load then lands on all engines alike instead of on whichever ran during it, and the
median over repetitions drops the burst. After the engines, the GEMM rate at the model's shapes
is measured and turned into each workload's roofline (:mod:`pagedkv.bench.throughput_gemm`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from pagedkv.bench.driver import run_settings
from pagedkv.bench.host_probe import host_state
from pagedkv.bench.machine_load import LoadMeter
from pagedkv.bench.throughput_config import ENGINE_TITLES, ThroughputConfig
from pagedkv.bench.throughput_engines import Engine, EngineUnavailable, LoadSpec, start_engine
from pagedkv.bench.throughput_gemm import measure_gemm, roofline_seconds
from pagedkv.bench.throughput_model import bench_model_path
from pagedkv.bench.throughput_result import EngineStatus, Measurement, ThroughputResult
from pagedkv.bench.throughput_workloads import Workload, build_workloads


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_throughput(config: ThroughputConfig) -> ThroughputResult:
    """Run everything the config asks for, on ``config.threads`` torch threads; progress lines
    go to stderr."""
    meter = LoadMeter()
    model_path = Path(config.model) if config.model else bench_model_path(config.out / "models")
    model_config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    workloads = build_workloads(config.workloads, config.shape, model_config["vocab_size"])
    result = ThroughputResult(config, model_path, model_config, workloads)
    with run_settings(config.threads):
        host = host_state("start")
        for dtype in config.dtypes:
            _run_dtype(result, dtype)
            if config.gemm:
                _progress(f"[{dtype}] timing GEMMs at the model's shapes")
                rates = measure_gemm(model_config, getattr(torch, dtype), workloads, config.prefill_chunk)
                result.gemm[dtype] = rates.timings
                for w in workloads:
                    result.roofline_s[(dtype, w.name)] = roofline_seconds(
                        model_config, w, rates, config.prefill_chunk
                    )
        host |= host_state("end")
    result.machine_load = meter.stop() | host
    result.wall_s = time.perf_counter() - meter.wall
    return result


def _load_spec(result: ThroughputResult, dtype: str) -> LoadSpec:
    workloads = result.workloads
    return LoadSpec(
        model=result.model_path,
        dtype=dtype,
        threads=result.config.threads,
        max_requests=max(w.num_requests for w in workloads),
        max_tokens_in_flight=max(w.prompt_tokens + w.generated_tokens for w in workloads),
        max_total_len=max(w.max_total_len for w in workloads),
    )


def _rival_options(config: ThroughputConfig, model_path: Path, dtype: str) -> dict[str, dict]:
    gguf_dir = config.out / "models" / "gguf"
    suffix = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    return {
        "vllm": {"python": config.vllm_python},
        "llamacpp": {
            "python": config.llamacpp_python,
            "load": {
                "gguf": str((gguf_dir / f"{model_path.name}-{suffix}.gguf").resolve()),
                "convert_script": config.llamacpp_convert,
                "kv_type": config.llamacpp_kv,
            },
        },
    }


def _run_dtype(result: ThroughputResult, dtype: str) -> None:
    config = result.config
    spec = _load_spec(result, dtype)
    rivals = _rival_options(config, result.model_path, dtype)
    status: dict[str, EngineStatus] = {}
    engines: dict[str, Engine] = {}
    result.status[dtype] = status
    for name in config.engines:
        _progress(f"[{dtype}] loading {ENGINE_TITLES[name]}")
        try:
            engines[name] = start_engine(name, spec, rivals, config.out / "logs")
            status[name] = EngineStatus("ok", info=engines[name].info)
        except EngineUnavailable as err:
            status[name] = EngineStatus("not run", str(err))
            _progress(f"[{dtype}] {ENGINE_TITLES[name]}: not run: {err}")
    try:
        for rep in range(config.repeats):
            for workload in result.workloads:
                for name, engine in list(engines.items()):
                    _run_one(result, name, engine, dtype, workload, rep)
                    if status[name].state == "failed":
                        engines.pop(name).close()
    finally:
        for engine in engines.values():
            engine.close()


def _run_one(result: ThroughputResult, name: str, engine: Engine, dtype: str, workload: Workload, rep: int):
    key = (name, dtype, workload.name)
    run = result.runs.setdefault(
        key, Measurement(name, dtype, workload.name, workload.generated_tokens, result.config.statistic)
    )
    try:
        elapsed, token_ids = engine.run(workload)
    except EngineUnavailable as err:
        result.status[dtype][name] = EngineStatus("failed", f"{workload.name}: {err}", engine.info)
        _progress(f"[{dtype}] {ENGINE_TITLES[name]} failed on {workload.name}: {err}")
        return
    run.elapsed_s.append(elapsed)
    if rep == 0:
        run.token_ids = token_ids
    _progress(
        f"[{dtype}] {rep + 1}/{result.config.repeats} {workload.name:>14s} {ENGINE_TITLES[name]:>28s}: "
        f"{workload.generated_tokens / elapsed:9,.1f} generated tok/s ({elapsed:.2f} s)"
    )
