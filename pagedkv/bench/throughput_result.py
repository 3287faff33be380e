"""The result of ``pagedkv bench throughput`` and the figures derived from it.

A :class:`ThroughputResult` holds what ran (each engine's state per dtype), every timed run and
the GEMM rates; the ``*_rows`` functions derive plain dicts from it -- tokens/s and ratios,
single-stream latency, agreement of the ids -- which are both its JSON and what
:mod:`pagedkv.bench.throughput_report` lays out as tables.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedkv.bench.throughput_config import ThroughputConfig
from pagedkv.bench.throughput_gemm import GemmTiming
from pagedkv.bench.throughput_workloads import Workload

#: The engines pagedkv's ratios are taken against.
RIVALS = ("vllm", "llamacpp", "transformers")


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
        """Every field but the ids, with the figures derived from the repetitions."""
        fields = {name: value for name, value in vars(self).items() if name != "token_ids"}
        figures = {"median_s": statistics.median(self.elapsed_s), "best_s": min(self.elapsed_s)}
        return fields | figures | {"tokens_per_s": self.tokens_per_s}


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
    #: what other processes used of the machine meanwhile (:mod:`pagedkv.bench.machine_load`),
    #: and the host's memory read rate at the start and the end (:mod:`pagedkv.bench.host_probe`).
    machine_load: dict = field(default_factory=dict)

    def measurement(self, engine: str, dtype: str, workload: str) -> Measurement | None:
        run = self.runs.get((engine, dtype, workload))
        return run if run is not None and run.elapsed_s else None

    def workload(self, name: str) -> Workload:
        return next(w for w in self.workloads if w.name == name)

    def to_json(self) -> dict:
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


# -- figures derived from a result ---------------------------------------------------------------
def _table_workloads(result: ThroughputResult) -> list[str]:
    return [w.name for w in result.workloads if w.name != "single-prefill"]


def throughput_rows(result: ThroughputResult) -> list[dict]:
    """Per (workload, dtype): each engine's generated tokens/s, pagedkv's ratio to it, the roofline."""
    rows = []
    for workload in _table_workloads(result):
        for dtype in result.config.dtypes:
            row: dict = {"workload": workload, "dtype": dtype, "tokens_per_s": {}, "pagedkv_over": {}}
            for engine in result.config.engines:
                run = result.measurement(engine, dtype, workload)
                row["tokens_per_s"][engine] = run.tokens_per_s if run else None
            ours = row["tokens_per_s"].get("pagedkv")
            for engine in RIVALS:
                theirs = row["tokens_per_s"].get(engine)
                row["pagedkv_over"][engine] = ours / theirs if ours and theirs else None
            roof = result.roofline_s.get((dtype, workload))
            row["roofline_tokens_per_s"] = result.workload(workload).generated_tokens / roof if roof else None
            row["pagedkv_of_roofline"] = ours / row["roofline_tokens_per_s"] if ours and roof else None
            rows.append(row)
    return rows


def latency_rows(result: ThroughputResult) -> list[dict]:
    """Single stream: time to first token (the 1-token twin), and decode ms per token from the
    difference between the full run and that twin, so prefill is not counted in it."""
    rows = []
    if "single" not in _table_workloads(result):
        return rows
    steps = result.workload("single").generated_tokens - 1
    for dtype in result.config.dtypes:
        for engine in result.config.engines:
            full = result.measurement(engine, dtype, "single")
            first = result.measurement(engine, dtype, "single-prefill")
            if full is None or first is None:
                continue
            # None when noise made the one-token run the slower: no figure beats a wrong one
            decode = (
                (full.seconds - first.seconds) / steps if steps and full.seconds > first.seconds else None
            )
            rows.append(
                {
                    "dtype": dtype,
                    "engine": engine,
                    "first_token_ms": first.seconds * 1e3,
                    "decode_ms_per_token": decode * 1e3 if decode is not None else None,
                    "end_to_end_ms_per_token": full.seconds / full.generated_tokens * 1e3,
                }
            )
    return rows


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(requests with identical ids, share of tokens generated before the first difference)."""
    same = sum(a == b for a, b in zip(tokens, reference, strict=True))
    agreed = 0
    for a, b in zip(tokens, reference, strict=True):
        agreed += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    total = sum(len(b) for b in reference)
    return same, agreed / total if total else 1.0


def agreement_rows(result: ThroughputResult) -> list[dict]:
    """Each engine's greedy ids against transformers' in the same dtype (pagedkv's when
    transformers did not run). In float32 they should be equal; in bfloat16 rounding differs
    between kernels, so ids part ways after a while and the share before that is what is shown."""
    rows = []
    for workload in _table_workloads(result):
        for dtype in result.config.dtypes:
            reference = next(
                (e for e in ("transformers", "pagedkv") if result.measurement(e, dtype, workload)), None
            )
            if reference is None:
                continue
            ref_tokens = result.measurement(reference, dtype, workload).token_ids
            for engine in result.config.engines:
                run = result.measurement(engine, dtype, workload)
                if engine == reference or run is None:
                    continue
                same, share = _agreement(run.token_ids, ref_tokens)
                rows.append(
                    {
                        "workload": workload,
                        "dtype": dtype,
                        "engine": engine,
                        "reference": reference,
                        "identical_requests": same,
                        "requests": len(ref_tokens),
                        "tokens_before_first_difference": share,
                    }
                )
    return rows
