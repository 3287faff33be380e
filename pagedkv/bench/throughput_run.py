"""The driver of ``pagedkv bench throughput``: every engine, workload and dtype in one run.

For each dtype the engines are loaded once, then take turns: repetition by repetition, workload
by workload, each engine runs the same ids. On a machine shared with other work a burst of
background load then lands on all engines alike instead of on whichever ran during it, and the
median over repetitions drops the burst. After the engines, the GEMM rate at the model's shapes
is measured and turned into each workload's roofline (:mod:`pagedkv.bench.throughput_gemm`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedkv.bench.machine_load import LoadMeter
from pagedkv.bench.throughput import DTYPES, ENGINE_NAMES, ENGINE_TITLES, STATISTICS
from pagedkv.bench.throughput_engines import Engine, EngineUnavailable, LoadSpec, start_engine
from pagedkv.bench.throughput_gemm import GemmTiming, measure_gemm, roofline_seconds
from pagedkv.bench.throughput_model import bench_model_path
from pagedkv.bench.throughput_workloads import WORKLOAD_NAMES, Workload, WorkloadShape, build_workloads


@dataclass(frozen=True)
class ThroughputConfig:
    engines: tuple[str, ...] = ENGINE_NAMES
    dtypes: tuple[str, ...] = DTYPES
    workloads: tuple[str, ...] = WORKLOAD_NAMES
    shape: WorkloadShape = WorkloadShape()
    repeats: int = 3
    threads: int = 2
    #: an HF folder; None: issue 12's Llama, written under ``out``.
    model: str | None = None
    out: Path = Path("pagedkv-report")
    vllm_python: str | None = None
    llamacpp_python: str | None = None
    llamacpp_convert: str | None = None
    #: llama.cpp's KV cache: "f16" (its default) or "model" (the model's dtype).
    llamacpp_kv: str = "f16"
    gemm: bool = True
    #: how repetitions become one figure: "median", or "best" (the fastest run: on a machine
    #: shared with bursts of other work, the run nothing disturbed).
    statistic: str = "median"
    #: prefill chunk of the roofline: pagedkv's default ``max_num_batched_tokens``.
    prefill_chunk: int = 2048

    def __post_init__(self) -> None:
        for name, allowed in (("engines", ENGINE_NAMES), ("dtypes", DTYPES), ("workloads", WORKLOAD_NAMES)):
            chosen = getattr(self, name)
            bad = [c for c in chosen if c not in allowed]
            if bad or not chosen:
                raise ValueError(f"{name} must be a non-empty subset of {allowed}, got {list(chosen)}")
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {self.statistic!r}")
        for name in ("repeats", "threads", "prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class EngineStatus:
    """Whether an engine ran in one dtype and, if not, why."""

    state: str  # "ok", "not run" or "failed"
    reason: str = ""
    info: dict = field(default_factory=dict)


@dataclass
class Measurement:
    engine: str
    dtype: str
    workload: str
    generated_tokens: int
    statistic: str = "median"
    elapsed_s: list[float] = field(default_factory=list)
    #: the ids of the first repetition (the ones compared across engines).
    token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def seconds(self) -> float:
        """The run's figure: the median or the best (shortest) of the repetitions."""
        return min(self.elapsed_s) if self.statistic == "best" else statistics.median(self.elapsed_s)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    def to_json(self) -> dict:
        return {
            "engine": self.engine,
            "dtype": self.dtype,
            "workload": self.workload,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": self.elapsed_s,
            "median_s": statistics.median(self.elapsed_s),
            "best_s": min(self.elapsed_s),
            "statistic": self.statistic,
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass
class ThroughputResult:
    config: ThroughputConfig
    model_path: Path
    model_config: dict
    workloads: list[Workload]
    status: dict[str, dict[str, EngineStatus]] = field(default_factory=dict)  # dtype -> engine ->
    runs: dict[tuple[str, str, str], Measurement] = field(default_factory=dict)  # (engine, dtype, wl)
    gemm: dict[str, list[GemmTiming]] = field(default_factory=dict)  # dtype ->
    roofline_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (dtype, workload) ->
    wall_s: float = 0.0
    #: what other processes used of the machine meanwhile (:mod:`pagedkv.bench.machine_load`).
    machine_load: dict = field(default_factory=dict)

    def measurement(self, engine: str, dtype: str, workload: str) -> Measurement | None:
        run = self.runs.get((engine, dtype, workload))
        return run if run is not None and run.elapsed_s else None

    def workload(self, name: str) -> Workload:
        return next(w for w in self.workloads if w.name == name)

    def to_json(self) -> dict:
        from pagedkv.bench.throughput_report import agreement_rows, latency_rows, throughput_rows

        config = asdict(self.config) | {"out": str(self.config.out)}
        return {
            "config": config,
            "model": {"path": str(self.model_path), "config": self.model_config},
            "machine": {"torch": torch.__version__, "threads": self.config.threads} | self.machine_load,
            "workloads": [
                {
                    "name": w.name,
                    "requests": w.num_requests,
                    "prompt_tokens": w.prompt_tokens,
                    "generated_tokens": w.generated_tokens,
                }
                for w in self.workloads
            ],
            "engines": {d: {e: asdict(s) for e, s in by.items()} for d, by in self.status.items()},
            "runs": [m.to_json() for m in self.runs.values() if m.elapsed_s],
            "throughput": throughput_rows(self),
            "latency": latency_rows(self),
            "agreement": agreement_rows(self),
            "gemm": {d: [t.to_json() for t in ts] for d, ts in self.gemm.items()},
            "roofline": [
                {
                    "dtype": d,
                    "workload": w,
                    "seconds": s,
                    "tokens_per_s": self.workload(w).generated_tokens / s,
                }
                for (d, w), s in self.roofline_s.items()
            ],
            "wall_s": self.wall_s,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_throughput(config: ThroughputConfig) -> ThroughputResult:
    """Run everything the config asks for; progress lines go to stderr."""
    meter = LoadMeter()
    torch.set_num_threads(config.threads)
    model_path = Path(config.model) if config.model else bench_model_path(config.out / "models")
    model_config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    workloads = build_workloads(config.workloads, config.shape, model_config["vocab_size"])
    result = ThroughputResult(config, model_path, model_config, workloads)
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
    result.machine_load = meter.stop()
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
