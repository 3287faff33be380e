"""Tables and plots of ``pagedkv bench capacity``: the figures per policy, the predictions, the claims.

The claims are about memory and are checked on counts -- requests running at once, KV slots held
empty, engine steps, preemptions -- which the scheduler decides from token and block counts
alone, so for a given workload they are the same on every host. The timed figures (tokens/s,
step time, time to first token) depend on the model, the CPU and other load: they are shown, with
what makes them up, and never checked. Every figure has a line saying what it is beside it.

The plots show KV utilization and concurrency over each policy's own clock (figures as
everywhere: :mod:`pagedkv.plotting`, imported only when plots are written).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from pagedkv.bench.capacity import CapacityResult
from pagedkv.bench.driver import cell, print_checks, table
from pagedkv.bench.hybrid_capacity import HybridCapacityResult, print_hybrid_capacity
from pagedkv.engine.core.kv_policy import CONTIGUOUS, CONTIGUOUS_ORACLE, KV_POLICIES, PAGED

#: The least concurrency paged must reach against contiguous ``max_model_len`` reservation.
MIN_RUNNING_RATIO = 2.0
#: The most of the slots it holds paged may leave empty once full: only last blocks' tails.
MAX_EMPTY_SHARE = 0.05
#: Work preemption may throw away before the scheduler counts as wasteful.
MAX_RECOMPUTED_SHARE = 0.05
POLICY_COLORS = {PAGED.name: "#2ca02c", CONTIGUOUS.name: "#d62728", CONTIGUOUS_ORACLE.name: "#9467bd"}


@dataclass(frozen=True)
class Row:
    """One figure of a table: its label, its key in ``PolicyRun.figures``, its format, what it
    is, and whether the paged / contiguous ratio is shown."""

    label: str
    figure: str
    spec: str
    meaning: str
    ratio: bool = True


#: Counts: the same on every host for a given workload.
COUNTED = (
    Row("running, peak", "peak_running", ".0f", "most requests in one step"),
    Row("running, mean once full", "mean_running_full", ".1f", "while requests waited for KV"),
    Row("running, mean over the run", "mean_running", ".1f", "every step, first to last"),
    Row("KV use once full", "utilization_full", ".1%", "filled slots / held slots"),
    Row("KV held empty once full", "empty_share_full", ".1%", "reserved ahead, or a block's tail", False),
    Row("KV use over the run", "mean_utilization", ".1%", "filled / held, every step"),
    Row("engine steps", "steps", ",.0f", "forward passes for the batch"),
    Row("generated tokens per step", "tokens_per_step", ".1f", "about one per running request"),
    Row("preemptions", "preemptions", ",.0f", "requests evicted, computed again", False),
    Row("tokens recomputed", "recomputed_tokens", ",.0f", "work preemption threw away", False),
    Row("tokens computed", "computed_tokens", ",.0f", "prompts, decodes, recomputation", False),
)
#: Timed on the policy's own clock: this host's figures, shown but never checked.
TIMED = (
    Row("generated tokens/s", "throughput_tokens_per_s", ",.0f", "tokens per step / step time"),
    Row("step time, mean (ms)", "step_time_mean_ms", ".2f", "a forward pass and scheduling"),
    Row("TTFT mean (s)", "ttft_mean_s", ".2f", "submission to first token", False),
    Row("TTFT p99 (s)", "ttft_p99_s", ".2f", "the same, 99th percentile", False),
    Row("wall time (s)", "wall_s", ".2f", "the whole batch", False),
)
#: Column headers short enough for an 80-column terminal; the report's first line names them.
HEADERS = {PAGED.name: "paged", CONTIGUOUS.name: "contig.", CONTIGUOUS_ORACLE.name: "oracle"}


def _ratio(value: float) -> str:
    return cell(value, ".2f", "x")


def _figures(result: CapacityResult, title: str, rows: tuple[Row, ...]) -> Table:
    """A table of ``rows``: a column per policy, the paged / contiguous ratio, what each figure is."""
    made = table(
        title,
        ("figure", *HEADERS.values(), "ratio", "what it is"),
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    made.columns[-1].justify = "left"
    for row in rows:
        values = [result.runs[p.name].figures[row.figure] for p in KV_POLICIES]
        ratio = _ratio(values[0] / values[1]) if row.ratio and values[1] else ""
        made.add_row(row.label, *(cell(v, row.spec) for v in values), ratio, row.meaning)
    return made


def print_capacity(result: CapacityResult | HybridCapacityResult, console: Console) -> None:
    """The counted and the timed figures, the predictions and the claims (``--hybrid``: the
    sequences held with hybrid paging on and off)."""
    if isinstance(result, HybridCapacityResult):
        print_hybrid_capacity(result, console)
        return
    config, runs = result.config, result.runs
    scaled = f" (every length / {config.scale})" if config.scale > 1 else ""
    repeats = f"; each step timed by the fastest of {config.repeats} runs of the same schedule" * (
        config.repeats > 1
    )
    console.print(
        f"[bold]KV capacity[/]: {config.num_requests} '{config.workload}' requests (seed {config.seed}) "
        f"submitted at once; KV budget {config.num_kv_blocks} blocks x {config.run_block_size} tokens, "
        f"max_model_len {config.run_max_model_len}{scaled}; one engine per KV policy, same model, pool "
        "and kernels. contig. = contiguous (max_model_len slots reserved per request at admission), "
        "oracle = contiguous-oracle (exactly prompt + max_tokens), ratio = paged / contig.; 'running' = "
        "requests running at once; averages are per engine step."
    )
    counted = _figures(result, "Counted: the same on every host for this workload", COUNTED)
    free = [cell(r.total_blocks - r.blocks_used_after) for r in runs.values()]
    counted.add_row("free blocks at the end", *free, "", f"all back: the pool has {config.num_kv_blocks:,}")
    console.print(counted)
    console.print(
        _figures(
            result,
            "Timed on this host, each policy on its own clock (they vary from run to run and are "
            f"not checked){repeats}",
            TIMED,
        )
    )
    console.print(_throughput_line(result))
    predictions = table(
        "Running requests once full: predicted vs live engine",
        ("policy", "simulator", "length-biased", "measured"),
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
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
    _print_claims(result, console)


def _throughput_line(result: CapacityResult) -> str:
    """Paged's tokens/s against contiguous, taken apart: a counted factor and a timed one."""
    ratio = result.ratio("throughput_tokens_per_s")
    per_step, step_time = result.ratio("tokens_per_step"), result.ratio("step_time_mean_ms")
    return (
        f"tokens/s, paged / contig.: {_ratio(ratio)} = {_ratio(per_step)} the tokens per step (more "
        f"requests share each step: counted) / {_ratio(step_time)} the time per step (what a step with "
        "more requests costs depends on the model, the CPU and its load: timed, so shown, not claimed)."
    )


@dataclass(frozen=True)
class Claim:
    """One checked line of the report: what is claimed, the figures that judge it, and whether
    it holds (None: a policy never filled the KV budget, so there is nothing to judge)."""

    claim: str
    figures: str
    holds: bool | None


def capacity_claims(result: CapacityResult) -> list[Claim]:
    """The report's claims, all on counts: the same verdicts on every host for a given workload."""
    paged, contiguous, oracle = (result.runs[p.name].figures for p in KV_POLICIES)

    def more_running(label: str, figure: str) -> Claim:
        ratio = result.ratio(figure)
        shown = f"{_ratio(ratio)} ({round(paged[figure], 1):g} vs {round(contiguous[figure], 1):g})"
        holds = ratio >= MIN_RUNNING_RATIO if math.isfinite(ratio) else None
        return Claim(f"requests at once ({label}): paged >= {MIN_RUNNING_RATIO:.0f}x contig.", shown, holds)

    empty = [cell(f["empty_share_full"], ".1%") for f in (paged, contiguous, oracle)]
    share = paged["empty_share_full"]
    return [
        more_running("peak", "peak_running"),
        more_running("mean once full", "mean_running_full"),
        Claim(
            f"paged leaves <= {MAX_EMPTY_SHARE:.0%} of its held KV slots empty once full",
            f"{empty[0]} (contig. {empty[1]}, oracle {empty[2]})",
            share <= MAX_EMPTY_SHARE if math.isfinite(share) else None,
        ),
        Claim(
            "paged finishes the batch in fewer engine steps than contig. and oracle",
            f"{paged['steps']} vs {contiguous['steps']} and {oracle['steps']}",
            paged["steps"] < min(contiguous["steps"], oracle["steps"]),
        ),
        Claim(
            f"paged recomputes < {MAX_RECOMPUTED_SHARE:.0%} of computed tokens",
            f"{paged['recomputed_share']:.1%} ({paged['preemptions']} preemptions, "
            f"{paged['recomputed_tokens']} of {paged['computed_tokens']} tokens)",
            paged["recomputed_share"] < MAX_RECOMPUTED_SHARE,
        ),
        Claim("every block back in the pool", "", result.ok),
    ]


def _print_claims(result: CapacityResult, console: Console) -> None:
    never = " and ".join(name for name, run in result.runs.items() if not run.full_window)
    for claim in capacity_claims(result):
        if claim.holds is None:
            console.print(
                f"  [yellow]n/a[/]  {claim.claim}: {never} never filled the KV budget (add requests)"
            )
        else:
            print_checks(
                console, [(f"{claim.claim}: {claim.figures}" if claim.figures else claim.claim, claim.holds)]
            )


def write_capacity_plots(result: CapacityResult | HybridCapacityResult, out_dir: str | Path) -> list[Path]:
    """KV utilization and concurrency over time, per policy, in ``out_dir``; their paths (none
    with ``--hybrid``, whose figures are a table)."""
    if isinstance(result, HybridCapacityResult):
        return []
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
