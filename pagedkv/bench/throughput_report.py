"""The result of ``pagedkv bench throughput``, the figures derived from it, and its tables.

A :class:`ThroughputResult` holds what ran (each engine's state per dtype), every timed run and
the GEMM rates; the ``*_rows`` functions derive plain dicts from it -- tokens/s and ratios,
single-stream latency, agreement of the ids -- which are both its JSON and its tables (narrow
enough for an 80-column terminal).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from pagedkv.bench.driver import cell, table
from pagedkv.bench.throughput import ENGINE_TITLES, ThroughputConfig, Workload
from pagedkv.bench.throughput_floor import DecodeFigure, decode_figure, floor_seconds, print_decode
from pagedkv.bench.throughput_gemm import KERNELS, GemmTiming

#: The engines pagedkv's ratios are taken against.
RIVALS = ("vllm", "llamacpp", "transformers")
SHORT = {
    "pagedkv": "pagedkv",
    "pagedkv-eager": "pagedkv eager",
    "vllm": "vLLM",
    "llamacpp": "llama.cpp",
    "transformers": "HF static",
}
DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16"}


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
    #: the host's memory read rate and GEMM scaling at the start and the end (:mod:`~pagedkv.bench.host`)
    host: dict = field(default_factory=dict)
    #: the device's measured copy rate, GB/s (:mod:`~pagedkv.bench.throughput_floor`), when
    #: decode batches ran
    copy_rate_gbs: float | None = None
    #: a GGUF model's tensors per ggml type (``{"Q4_1": 210, "F32": 61}``); empty for a checkpoint
    weight_types: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Some engine ran and none failed."""
        states = [s.state for by in self.status.values() for s in by.values()]
        return "ok" in states and "failed" not in states

    def record(self, engine: str, dtype: str, workload: Workload, elapsed: float, token_ids: list) -> None:
        key = (engine, dtype, workload.name)
        if key not in self.runs:  # the first repetition's ids are the ones compared
            self.runs[key] = Measurement(
                *key, workload.generated_tokens, self.config.statistic, [], token_ids
            )
        self.runs[key].elapsed_s.append(elapsed)

    def measurement(self, engine: str, dtype: str, workload: str) -> Measurement | None:
        return self.runs.get((engine, dtype, workload))

    def workload(self, name: str) -> Workload:
        return next(w for w in self.workloads if w.name == name)

    def to_json(self) -> dict:
        return {
            "config": asdict(self.config),
            "model": {
                "path": str(self.model_path),
                "config": self.model_config,
                "weight_types": self.weight_types,
            },
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
            "runs": [m.to_json() for m in self.runs.values()],
            "throughput": throughput_rows(self),
            "latency": latency_rows(self),
            "agreement": agreement_rows(self),
            "copy_rate_gbs": self.copy_rate_gbs,
            "decode": [f.to_json() for f in decode_rows(self)],
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
        }


# -- figures derived from a result ---------------------------------------------------------------
def _table_workloads(result: ThroughputResult) -> list[str]:
    return [w.name for w in result.workloads if not w.name.endswith("-prefill")]


def decode_rows(result: ThroughputResult) -> list[DecodeFigure]:
    """Each engine's decode step at each ``--decode-batches`` size, against the floor."""
    config, rate, figures = result.config, result.copy_rate_gbs, []
    if rate is None:
        return figures
    for batch in config.decode_batches:
        full_name = f"decode-{batch}"
        steps = max(result.workload(full_name).max_tokens) - 1
        for dtype in config.dtypes:
            floor = floor_seconds(
                result.model_config, dtype, batch, config.prompt_len, config.max_tokens, rate
            )
            for engine in config.engines:
                full = result.measurement(engine, dtype, full_name)
                first = result.measurement(engine, dtype, f"{full_name}-prefill")
                if full is not None and first is not None:
                    figures.append(
                        decode_figure(engine, dtype, batch, full.seconds, first.seconds, steps, floor)
                    )
    return figures


def throughput_rows(result: ThroughputResult) -> list[dict]:
    """Per (workload, dtype): each engine's generated tokens/s, pagedkv's ratio to it, the roofline."""
    rows = []
    for workload in _table_workloads(result):
        for dtype in result.config.dtypes:
            rates = {}
            for engine in result.config.engines:
                run = result.measurement(engine, dtype, workload)
                rates[engine] = run.tokens_per_s if run else None
            ours = rates.get("pagedkv")
            over = {e: ours / rates[e] if ours and rates.get(e) else None for e in RIVALS}
            roof = result.roofline_s.get((dtype, workload))
            roof_rate = result.workload(workload).generated_tokens / roof if roof else None
            rows.append(
                {
                    "workload": workload,
                    "dtype": dtype,
                    "tokens_per_s": rates,
                    "pagedkv_over": over,
                    "roofline_tokens_per_s": roof_rate,
                    "pagedkv_of_roofline": ours / roof_rate if ours and roof else None,
                }
            )
    return rows


def latency_rows(result: ThroughputResult) -> list[dict]:
    """Single stream: time to first token (the 1-token twin), and decode ms per token from the
    difference between the full run and that twin, so prefill is not counted in it."""
    if "single" not in _table_workloads(result):
        return []
    rows, steps = [], result.workload("single").generated_tokens - 1
    for dtype in result.config.dtypes:
        for engine in result.config.engines:
            full = result.measurement(engine, dtype, "single")
            first = result.measurement(engine, dtype, "single-prefill")
            if full is None or first is None:
                continue
            # None when noise made the one-token run the slower: no figure beats a wrong one
            slower = steps and full.seconds > first.seconds
            rows.append(
                {
                    "dtype": dtype,
                    "engine": engine,
                    "first_token_ms": first.seconds * 1e3,
                    "decode_ms_per_token": (full.seconds - first.seconds) / steps * 1e3 if slower else None,
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
            runs = {e: result.measurement(e, dtype, workload) for e in result.config.engines}
            reference = next((e for e in ("transformers", "pagedkv") if runs.get(e)), None)
            for engine, run in runs.items():
                if reference is None or engine == reference or run is None:
                    continue
                same, share = _agreement(run.token_ids, runs[reference].token_ids)
                rows.append(
                    {
                        "workload": workload,
                        "dtype": dtype,
                        "engine": engine,
                        "reference": reference,
                        "identical_requests": same,
                        "requests": len(run.token_ids),
                        "tokens_before_first_difference": share,
                    }
                )
    return rows


# -- tables --------------------------------------------------------------------------------------
def print_throughput(result: ThroughputResult, console: Console) -> None:
    config, engines = result.config, result.config.engines
    uniform = f"{config.num_requests} x ({config.prompt_len} + {config.max_tokens})"
    console.print(
        f"[bold]Generated tokens/s[/] ({config.statistic} of {config.repeats}; greedy, ignore_eos, "
        f"{config.threads} threads; uniform = {uniform})"
    )
    rows = throughput_rows(result)
    rates = table(
        None, ("workload", "dtype", *(SHORT[e] for e in engines), "roofline"), left=2, show_edge=False
    )
    rivals = [e for e in RIVALS if e in engines]
    ratios = table(
        "pagedkv / engine (tokens/s ratio)",
        ("workload", "dtype", *(f"/ {SHORT[e]}" for e in rivals), "% of roofline"),
        left=2,
        show_edge=False,
    )
    for row in rows:
        name, dtype = row["workload"], DTYPE_LABELS[row["dtype"]]
        states = [result.status.get(row["dtype"], {}).get(e) for e in engines]
        cells = [
            cell(row["tokens_per_s"][e]) if row["tokens_per_s"][e] or not s else s.state
            for e, s in zip(engines, states, strict=True)
        ]
        rates.add_row(name, dtype, *cells, cell(row["roofline_tokens_per_s"]))
        share = row["pagedkv_of_roofline"]
        ratios.add_row(
            name,
            dtype,
            *(cell(row["pagedkv_over"][e], ".2f") for e in rivals),
            cell(share and share * 100, ".0f"),
        )
    console.print(rates)
    console.print(ratios)
    for dtype, by_engine in result.status.items():
        for engine, status in by_engine.items():
            if status.state != "ok":
                console.print(f"  {ENGINE_TITLES[engine]} ({dtype}): {status.state}: {status.reason}")


def print_latency(result: ThroughputResult, console: Console) -> None:
    rows = latency_rows(result)
    if not rows:
        return
    single = result.workload("single")
    latency = table(
        f"One request, {single.prompt_tokens} prompt + {single.generated_tokens} new "
        "(pagedkv / engine: decode speed ratio)",
        ("dtype", "engine", "first token ms", "decode ms/token", "pagedkv / engine"),
        left=2,
        show_edge=False,
    )
    ours = {r["dtype"]: r["decode_ms_per_token"] for r in rows if r["engine"] == "pagedkv"}
    for r in rows:
        mine, theirs = ours.get(r["dtype"]), r["decode_ms_per_token"]
        speed = theirs / mine if mine and theirs and r["engine"] != "pagedkv" else None
        cells = (cell(r["first_token_ms"], ".1f"), cell(theirs, ".2f"), cell(speed, ".2f", "x"))
        latency.add_row(DTYPE_LABELS[r["dtype"]], SHORT[r["engine"]], *cells)
    console.print(latency)


def print_agreement(result: ThroughputResult, console: Console) -> None:
    rows = agreement_rows(result)
    if not rows:
        return
    agreement = table(
        "Greedy ids against the reference: same requests, share of ids before the first difference",
        ("workload", "dtype", "engine", "vs", "same requests", "ids agree"),
        left=4,
        show_edge=False,
    )
    for r in rows:
        agreement.add_row(
            r["workload"],
            DTYPE_LABELS[r["dtype"]],
            SHORT[r["engine"]],
            SHORT[r["reference"]],
            f"{r['identical_requests']}/{r['requests']}",
            f"{r['tokens_before_first_difference']:.1%}",
        )
    console.print(agreement)


def print_gemm(result: ThroughputResult, console: Console) -> None:
    """The measured rates at batch 1, the largest decode batch and the prefill chunk (all sizes in --json)."""
    for dtype, timings in result.gemm.items():
        sizes = sorted({t.m for t in timings})
        shown = sorted({sizes[0], max(t.m for t in timings if t.shape == "lm_head"), sizes[-1]})
        gemm = table(
            f"GEMM rate, {dtype}, {result.config.threads} threads: ms (GFLOP/s)",
            ("matrix", "M x K -> N", *KERNELS),
            show_edge=False,
        )
        for shape in dict.fromkeys(t.shape for t in timings):
            for m in shown:
                by_kernel = {t.kernel: t for t in timings if t.shape == shape and t.m == m}
                if by_kernel:
                    any_t = next(iter(by_kernel.values()))
                    cells = [t.cell() if t else "n/a" for t in map(by_kernel.get, KERNELS)]
                    gemm.add_row(shape, f"{m} x {any_t.k} -> {any_t.n}", *cells)
        console.print(gemm)


def print_result(result: ThroughputResult, console: Console) -> None:
    print_throughput(result, console)
    print_latency(result, console)
    print_decode(decode_rows(result), ENGINE_TITLES, result.copy_rate_gbs, console)
    print_agreement(result, console)
    print_gemm(result, console)
    types = ", ".join(f"{name} x {count}" for name, count in result.weight_types.items())
    console.print(
        f"model: {result.model_path}"
        + (f" (GGUF tensors: {types})" if types else "")
        + " | roofline: linear layers only, at the fastest kernel's warm-cache rate"
    )
