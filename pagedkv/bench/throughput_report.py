"""Tables of ``pagedkv bench throughput``: tokens/s, ratios, latency, agreement, GEMMs.

The ``print_*`` functions lay out the rows :mod:`pagedkv.bench.throughput_result` derives (the
same rows are the JSON) as rich tables narrow enough for an 80-column terminal.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from pagedkv.bench.throughput_config import ENGINE_TITLES
from pagedkv.bench.throughput_gemm import KERNELS
from pagedkv.bench.throughput_result import (
    RIVALS,
    ThroughputResult,
    agreement_rows,
    latency_rows,
    throughput_rows,
)

SHORT = {"pagedkv": "pagedkv", "vllm": "vLLM", "llamacpp": "llama.cpp", "transformers": "HF static"}
DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16"}


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def print_throughput(result: ThroughputResult, console: Console) -> None:
    engines = result.config.engines
    reps = result.config.repeats
    shape, stat = result.config.shape, result.config.statistic
    console.print(
        f"[bold]Generated tokens/s[/] ({stat} of {reps}; greedy, ignore_eos, {result.config.threads} "
        f"threads; uniform = {shape.num_requests} x ({shape.prompt_len} + {shape.max_tokens}))"
    )
    rows = throughput_rows(result)
    table = Table(show_edge=False)
    for title in ("workload", "dtype", *(SHORT[e] for e in engines), "roofline"):
        table.add_column(title, justify="left" if title in ("workload", "dtype") else "right")
    for row in rows:
        cells = [_cell(result, e, row["dtype"], row["tokens_per_s"][e]) for e in engines]
        table.add_row(row["workload"], DTYPE_LABELS[row["dtype"]], *cells, _num(row["roofline_tokens_per_s"]))
    console.print(table)
    rivals = [e for e in RIVALS if e in engines]
    table = Table(title="pagedkv / engine (tokens/s ratio)", show_edge=False)
    for title in ("workload", "dtype", *(f"/ {SHORT[e]}" for e in rivals), "% of roofline"):
        table.add_column(title, justify="left" if title in ("workload", "dtype") else "right")
    for row in rows:
        ratios = [_num(row["pagedkv_over"][e], ".2f") for e in rivals]
        share = row["pagedkv_of_roofline"]
        table.add_row(
            row["workload"], DTYPE_LABELS[row["dtype"]], *ratios, _num(share * 100 if share else None, ".0f")
        )
    console.print(table)
    _print_reasons(result, console)


def _cell(result: ThroughputResult, engine: str, dtype: str, value: float | None) -> str:
    if value is not None:
        return _num(value)
    status = result.status.get(dtype, {}).get(engine)
    return status.state if status is not None else "-"


def _print_reasons(result: ThroughputResult, console: Console) -> None:
    for dtype, by_engine in result.status.items():
        for engine, status in by_engine.items():
            if status.state != "ok":
                console.print(f"  {ENGINE_TITLES[engine]} ({dtype}): {status.state}: {status.reason}")


def print_latency(result: ThroughputResult, console: Console) -> None:
    rows = latency_rows(result)
    if not rows:
        return
    shape = result.workload("single")
    table = Table(
        title=f"One request, {shape.prompt_tokens} prompt + {shape.generated_tokens} new "
        "(pagedkv / engine: decode speed ratio)",
        show_edge=False,
    )
    for title in ("dtype", "engine", "first token ms", "decode ms/token", "pagedkv / engine"):
        table.add_column(title, justify="left" if title in ("dtype", "engine") else "right")
    ours = {r["dtype"]: r["decode_ms_per_token"] for r in rows if r["engine"] == "pagedkv"}
    for r in rows:
        mine, theirs = ours.get(r["dtype"]), r["decode_ms_per_token"]
        speed = theirs / mine if mine and theirs and r["engine"] != "pagedkv" else None
        table.add_row(
            DTYPE_LABELS[r["dtype"]],
            SHORT[r["engine"]],
            _num(r["first_token_ms"], ".1f"),
            _num(theirs, ".2f"),
            _num(speed, ".2f") + ("x" if speed else ""),
        )
    console.print(table)


def print_agreement(result: ThroughputResult, console: Console) -> None:
    rows = agreement_rows(result)
    if not rows:
        return
    table = Table(
        title="Greedy ids against the reference: same requests, share of ids before the first difference",
        show_edge=False,
    )
    for title in ("workload", "dtype", "engine", "vs", "same requests", "ids agree"):
        table.add_column(title, justify="right" if title in ("same requests", "ids agree") else "left")
    for r in rows:
        table.add_row(
            r["workload"],
            DTYPE_LABELS[r["dtype"]],
            SHORT[r["engine"]],
            SHORT[r["reference"]],
            f"{r['identical_requests']}/{r['requests']}",
            f"{r['tokens_before_first_difference']:.1%}",
        )
    console.print(table)


def print_gemm(result: ThroughputResult, console: Console) -> None:
    """The measured rates at batch 1, the largest decode batch and the prefill chunk (all sizes in --json)."""
    for dtype, timings in result.gemm.items():
        sizes = sorted({t.m for t in timings if t.shape == "lm_head"} | {t.m for t in timings})
        shown = {sizes[0], max(t.m for t in timings if t.shape == "lm_head"), sizes[-1]}
        table = Table(
            title=f"GEMM rate, {dtype}, {result.config.threads} threads: ms (GFLOP/s)", show_edge=False
        )
        for title in ("matrix", "M x K -> N", *KERNELS):
            table.add_column(title, justify="left" if title == "matrix" else "right")
        for shape in dict.fromkeys(t.shape for t in timings):
            for m in sorted(shown):
                by_kernel = {t.kernel: t for t in timings if t.shape == shape and t.m == m}
                if not by_kernel:
                    continue
                any_t = next(iter(by_kernel.values()))
                cells = [_gemm_cell(by_kernel.get(k)) for k in KERNELS]
                table.add_row(shape, f"{m} x {any_t.k} -> {any_t.n}", *cells)
        console.print(table)


def _gemm_cell(timing) -> str:
    if timing is None or timing.ms is None:
        return "n/a"
    return f"{timing.ms:.2f} ({timing.gflops:,.0f})"


def print_result(result: ThroughputResult, console: Console) -> None:
    print_throughput(result, console)
    print_latency(result, console)
    print_agreement(result, console)
    print_gemm(result, console)
    console.print(
        f"model: {result.model_path} | roofline: linear layers only, at the fastest kernel's warm-cache "
        f"rate | wall time {result.wall_s:.0f} s"
    )
    load = result.machine_load
    if load.get("other_cpu_share") is not None:
        console.print(
            f"other work on this machine during the run: {load['other_cpu_share']:.0%} of its "
            f"{load['cpus']} CPUs (1-min load average {load['loadavg_1min_start']:.1f} -> "
            f"{load['loadavg_1min_end']:.1f})"
        )
    if load.get("memory_read_gbs_start") is not None:
        console.print(
            f"memory read rate, start -> end: {load['memory_read_gbs_start']:.1f} -> "
            f"{load['memory_read_gbs_end']:.1f} GB/s (a 64 MiB tensor sum; other tenants of a shared "
            "host show here, not above)"
        )
    if load.get("parallel_speedup_start") is not None:
        console.print(
            f"a small GEMM on {result.config.threads} threads against one, start -> end: "
            f"{load['parallel_speedup_start']:.2f}x -> {load['parallel_speedup_end']:.2f}x (near 1x: "
            "the other CPUs were not really there)"
        )
