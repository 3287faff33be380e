"""What ``pagedkv bench throughput`` runs: engines, dtypes, workloads, repeats and the rivals' venvs.

Pure Python (no torch): the command line builds its parser and checks its options from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedkv.bench.throughput_workloads import WORKLOAD_NAMES, WorkloadShape
from pagedkv.cli_args import DEFAULT_OUT
from pagedkv.engine.config import EngineConfig

#: Engine names in table order, and how tables title them.
ENGINE_NAMES = ("pagedkv", "vllm", "llamacpp", "transformers")
ENGINE_TITLES = {
    "pagedkv": "pagedkv",
    "vllm": "vLLM-cpu",
    "llamacpp": "llama.cpp",
    "transformers": "transformers (static batch)",
}
DTYPES = ("float32", "bfloat16")
STATISTICS = ("median", "best")


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
    out: Path = Path(DEFAULT_OUT)
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
    prefill_chunk: int = EngineConfig.max_num_batched_tokens

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
