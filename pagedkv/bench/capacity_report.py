"""Tables of ``pagedkv bench capacity``: the figures per policy, the predictions, the targets."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from pagedkv.bench.capacity import CapacityResult
from pagedkv.engine.kv_policy import CONTIGUOUS, CONTIGUOUS_ORACLE, KV_POLICIES, PAGED

#: Work preemption may throw away before the scheduler counts as wasteful (issue 12).
MAX_RECOMPUTED_SHARE = 0.05


def _ratio(value: float) -> str:
    return f"{value:.2f}x" if math.isfinite(value) else "-"


def _show(fmt: str, value: float) -> str:
    """A figure, or "-" where it does not exist (a policy whose batch never filled memory)."""
    return fmt.format(value) if math.isfinite(value) else "-"


def print_capacity(result: CapacityResult, console: Console) -> None:
    """The figures table, the simulator comparison and the issue's targets."""
    config, runs = result.config, result.runs
    console.print(
        f"[bold]KV capacity[/]: {config.num_requests} '{config.workload}' requests (seed {config.seed}) "
        f"submitted at once; KV budget {config.num_kv_blocks} blocks x {config.run_block_size} tokens, "
        f"max_model_len {config.run_max_model_len}"
        + (f" (every length / {config.scale})" if config.scale > 1 else "")
        + ". 'running' = requests running at once; 'KV use' = token slots holding a token / slots held. "
        "Averages are per engine step; times are each policy's own clock"
        + (
            f", each step timed by the fastest of {config.repeats} runs of the same schedule."
            if config.repeats > 1
            else "."
        )
    )
    table = Table(title="paged vs contiguous reservation, same model, pool and kernels")
    table.add_column("figure")
    for policy in KV_POLICIES:
        table.add_column(policy.name, justify="right")
    table.add_column("paged/contig.", justify="right")
    rows = [
        ("running, peak", "peak_running", "{:.0f}", True),
        ("running, mean once full", "mean_running_full", "{:.1f}", True),
        ("running, mean over the run", "mean_running", "{:.1f}", True),
        ("KV use once full", "utilization_full", "{:.1%}", True),
        ("KV use over the run", "mean_utilization", "{:.1%}", True),
        ("generated tokens/s", "throughput", "{:.0f}", True),
        ("TTFT mean (s)", "ttft_mean", "{:.2f}", False),
        ("TTFT p99 (s)", "ttft_p99", "{:.2f}", False),
        ("preemptions", "preemptions", "{}", False),
        ("tokens recomputed after preemption", "recomputed_tokens", "{}", False),
        ("tokens computed (recomputation included)", "computed_tokens", "{}", False),
        ("share of computed tokens recomputed", "recomputed_share", "{:.1%}", False),
        ("engine steps", "steps", "{}", False),
        ("wall time (s)", "wall_s", "{:.1f}", False),
    ]
    for label, key, fmt, with_ratio in rows:
        values = [getattr(runs[p.name], key) for p in KV_POLICIES]
        ratio = _ratio(values[0] / values[1]) if with_ratio and values[1] else ""
        table.add_row(label, *(_show(fmt, v) for v in values), ratio)
    table.add_row(
        "blocks back at the end",
        *(f"{r.total_blocks - r.blocks_used_after}/{r.total_blocks}" for r in runs.values()),
        "",
    )
    console.print(table)
    _print_prediction(result, console)
    _print_targets(result, console)


def _print_prediction(result: CapacityResult, console: Console) -> None:
    table = Table(title="running requests once full: predicted vs live engine")
    for name in ("policy", "simulator", "length-biased", "measured"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    columns = (
        result.predicted,
        result.length_biased,
        {p: r.mean_running_full for p, r in result.runs.items()},
    )
    for policy in KV_POLICIES:
        table.add_row(policy.name, *(_show("{:.1f}", figures[policy.name]) for figures in columns))
    table.add_row("paged/contig.", *(_ratio(f[PAGED.name] / f[CONTIGUOUS.name]) for f in columns))
    console.print(table)
    console.print(
        "simulator: requests at uniformly random progress, each equally likely (its capacity "
        "experiment, full scale). length-biased: the same in closed form from this run's requests, "
        "each weighted by its output length, as a full batch holds them."
    )


def _print_targets(result: CapacityResult, console: Console) -> None:
    paged = result.runs[PAGED.name]
    checks = [
        (
            "paged >= 2x contiguous concurrent requests (mean once full)",
            result.ratio("mean_running_full"),
            2.0,
        ),
        ("paged >= 2x contiguous concurrent requests (peak)", result.ratio("peak_running"), 2.0),
        ("paged >= 1.5x contiguous throughput", result.ratio("throughput"), 1.5),
        (
            "paged >= contiguous-oracle throughput",
            result.ratio("throughput", baseline=CONTIGUOUS_ORACLE),
            1.0,
        ),
        ("paged KV utilization >= 95% once full", paged.utilization_full, 0.95),
    ]
    for label, value, target in checks:
        if not math.isfinite(value):
            never = [name for name, run in result.runs.items() if not run.full_window]
            console.print(
                f"  [yellow]n/a[/]  {label}: {' and '.join(never)} never filled the KV budget (add requests)"
            )
            continue
        mark = "[green]met[/]" if value >= target else "[red]NOT met[/]"
        console.print(f"  {mark}  {label}: {value:.2f}")
    share = paged.recomputed_share
    mark = "[green]met[/]" if share < MAX_RECOMPUTED_SHARE else "[red]NOT met[/]"
    console.print(
        f"  {mark}  paged recomputes < {MAX_RECOMPUTED_SHARE:.0%} of computed tokens: {share:.1%} "
        f"({paged.preemptions} preemptions, {paged.recomputed_tokens} of {paged.computed_tokens} tokens)"
    )
    back = all(run.blocks_returned for run in result.runs.values())
    console.print(f"  {'[green]met[/]' if back else '[red]NOT met[/]'}  every block back in the pool")
