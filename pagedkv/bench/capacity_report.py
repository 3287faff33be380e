"""Tables and plots of ``pagedkv bench capacity``: the figures per policy, the predictions, the goals.

The plots show KV utilization and concurrency over each policy's own clock (figures as
everywhere: :mod:`pagedkv.plotting`, imported only when plots are written).
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console

from pagedkv.bench.capacity import CapacityResult
from pagedkv.bench.driver import cell, print_checks, table
from pagedkv.engine.kv_policy import CONTIGUOUS, CONTIGUOUS_ORACLE, KV_POLICIES, PAGED

#: Work preemption may throw away before the scheduler counts as wasteful.
MAX_RECOMPUTED_SHARE = 0.05
POLICY_COLORS = {PAGED.name: "#2ca02c", CONTIGUOUS.name: "#d62728", CONTIGUOUS_ORACLE.name: "#9467bd"}
#: (label, figure, format, with the paged / contiguous ratio)
ROWS = (
    ("running, peak", "peak_running", ".0f", True),
    ("running, mean once full", "mean_running_full", ".1f", True),
    ("running, mean over the run", "mean_running", ".1f", True),
    ("KV use once full", "utilization_full", ".1%", True),
    ("KV use over the run", "mean_utilization", ".1%", True),
    ("generated tokens/s", "throughput_tokens_per_s", ".0f", True),
    ("TTFT mean (s)", "ttft_mean_s", ".2f", False),
    ("TTFT p99 (s)", "ttft_p99_s", ".2f", False),
    ("preemptions", "preemptions", "", False),
    ("tokens recomputed after preemption", "recomputed_tokens", "", False),
    ("tokens computed (recomputation included)", "computed_tokens", "", False),
    ("share of computed tokens recomputed", "recomputed_share", ".1%", False),
    ("engine steps", "steps", "", False),
    ("wall time (s)", "wall_s", ".1f", False),
)


def _ratio(value: float) -> str:
    return cell(value, ".2f", "x")


def print_capacity(result: CapacityResult, console: Console) -> None:
    """The figures table, the predictions and the goals."""
    config, runs = result.config, result.runs
    scaled = f" (every length / {config.scale})" if config.scale > 1 else ""
    repeats = f", each step timed by the fastest of {config.repeats} runs of the same schedule" * (
        config.repeats > 1
    )
    console.print(
        f"[bold]KV capacity[/]: {config.num_requests} '{config.workload}' requests (seed {config.seed}) "
        f"submitted at once; KV budget {config.num_kv_blocks} blocks x {config.run_block_size} tokens, "
        f"max_model_len {config.run_max_model_len}{scaled}. 'running' = requests running at once; 'KV use' "
        f"= token slots holding a token / slots held. Averages are per engine step; times are each "
        f"policy's own clock{repeats}."
    )
    figures = table(
        "paged vs contiguous reservation, same model, pool and kernels",
        ("figure", *(p.name for p in KV_POLICIES), "paged/contig."),
    )
    for label, key, spec, with_ratio in ROWS:
        values = [runs[p.name].figures[key] for p in KV_POLICIES]
        ratio = _ratio(values[0] / values[1]) if with_ratio and values[1] else ""
        figures.add_row(label, *(cell(v, spec) for v in values), ratio)
    back = [f"{r.total_blocks - r.blocks_used_after}/{r.total_blocks}" for r in runs.values()]
    figures.add_row("blocks back at the end", *back, "")
    console.print(figures)
    predictions = table(
        "running requests once full: predicted vs live engine",
        ("policy", "simulator", "length-biased", "measured"),
    )
    columns = (
        result.predicted,
        result.length_biased,
        {p: r.figures["mean_running_full"] for p, r in runs.items()},
    )
    for policy in KV_POLICIES:
        predictions.add_row(policy.name, *(cell(f[policy.name], ".1f") for f in columns))
    predictions.add_row("paged/contig.", *(_ratio(f[PAGED.name] / f[CONTIGUOUS.name]) for f in columns))
    console.print(predictions)
    console.print(
        "simulator: requests at uniformly random progress, each equally likely (its capacity "
        "experiment, full scale). length-biased: the same in closed form from this run's requests, "
        "each weighted by its output length, as a full batch holds them."
    )
    _print_goals(result, console)


def _print_goals(result: CapacityResult, console: Console) -> None:
    paged = result.runs[PAGED.name].figures
    goals = [
        (
            "paged >= 2x contiguous concurrent requests (mean once full)",
            result.ratio("mean_running_full"),
            2.0,
        ),
        ("paged >= 2x contiguous concurrent requests (peak)", result.ratio("peak_running"), 2.0),
        ("paged >= 1.5x contiguous throughput", result.ratio("throughput_tokens_per_s"), 1.5),
        (
            "paged >= contiguous-oracle throughput",
            result.ratio("throughput_tokens_per_s", baseline=CONTIGUOUS_ORACLE),
            1.0,
        ),
        ("paged KV utilization >= 95% once full", paged["utilization_full"], 0.95),
    ]
    for label, value, target in goals:
        if math.isfinite(value):
            print_checks(console, [(f"{label}: {value:.2f}", value >= target)])
        else:
            never = " and ".join(name for name, run in result.runs.items() if not run.full_window)
            console.print(f"  [yellow]n/a[/]  {label}: {never} never filled the KV budget (add requests)")
    share = paged["recomputed_share"]
    recomputed = f"{paged['recomputed_tokens']} of {paged['computed_tokens']} tokens"
    limit = f"paged recomputes < {MAX_RECOMPUTED_SHARE:.0%} of computed tokens"
    print_checks(
        console,
        [
            (
                f"{limit}: {share:.1%} ({paged['preemptions']} preemptions, {recomputed})",
                share < MAX_RECOMPUTED_SHARE,
            ),
            ("every block back in the pool", result.ok),
        ],
    )


def write_capacity_plots(result: CapacityResult, out_dir: str | Path) -> list[Path]:
    """KV utilization and concurrency over time, per policy, in ``out_dir``; their paths."""
    from pagedkv.plotting import new_figure, save, write_figures

    config = result.config

    def axes(title: str, ylabel: str):
        fig = new_figure(8, 5)
        ax = fig.add_subplot()
        ax.set_title(
            f"{title}\n{config.num_requests} '{config.workload}' requests at t=0, {config.num_kv_blocks} "
            f"blocks x {config.run_block_size} tokens, max_model_len {config.run_max_model_len}",
            fontsize=10,
        )
        ax.set(xlabel="time (s, each policy's own clock)", ylabel=ylabel)
        ax.grid(alpha=0.3)
        return fig, ax

    def once_full(value: float, spec: str) -> str:
        return f"once full: {value:{spec}}" if math.isfinite(value) else "never full"

    def utilization(result: CapacityResult, path: Path) -> Path:
        fig, ax = axes("KV utilization: token slots holding a token / slots held", "utilization (%)")
        for policy, run in result.runs.items():
            points = [(s.elapsed, 100 * run.utilization(s)) for s in run.samples if s.used_blocks]
            label = f"{policy} ({once_full(run.figures['utilization_full'], '.1%')})"
            ax.plot(*zip(*points, strict=True), color=POLICY_COLORS[policy], label=label, linewidth=1.5)
        ax.axhline(95, color="gray", linestyle=":", linewidth=1, label="95%")
        ax.set_ylim(0, 105)
        fig.legend(loc="outside lower center", ncols=2, fontsize=9)
        return save(fig, path)

    def concurrency(result: CapacityResult, path: Path) -> Path:
        fig, ax = axes("Concurrent running requests", "running requests")
        for policy, run in result.runs.items():
            color, figures = POLICY_COLORS[policy], run.figures
            mean_full = once_full(figures["mean_running_full"], ".1f")
            label = f"{policy} (peak {figures['peak_running']}, mean {mean_full})"
            ax.plot(
                [s.elapsed for s in run.samples], [s.running for s in run.samples], color=color, label=label
            )
            ax.axhline(result.predicted[policy], color=color, linestyle="--", linewidth=1, alpha=0.8)
            ax.axhline(result.length_biased[policy], color=color, linestyle=":", linewidth=1.2, alpha=0.9)
        ax.plot([], [], color="gray", linestyle="--", label="simulator prediction (same colour)")
        ax.plot([], [], color="gray", linestyle=":", label="length-biased prediction (same colour)")
        ax.set_ylim(bottom=0)
        fig.legend(loc="outside lower center", ncols=2, fontsize=9)
        return save(fig, path)

    figures = {"capacity_utilization.png": utilization, "capacity_concurrency.png": concurrency}
    return write_figures(result, out_dir, figures)
