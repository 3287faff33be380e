"""Tables and plots of ``pagedkv bench sharing``: what was measured, next to the paper's figures.

Plots as everywhere: :mod:`pagedkv.plotting`, imported only when plots are written.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console

from pagedkv.bench.driver import cell, mean, print_checks, table
from pagedkv.bench.sharing import PAPER_SAVING, PrefixPoint, SharingResult
from pagedkv.memory import blocks_for

KIND_COLORS = {"parallel": "#1f77b4", "beam": "#ff7f0e"}
KIND_LABELS = {"parallel": "parallel sampling", "beam": "beam search"}
PREFIX_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def _pct(value: float) -> str:
    return cell(value, ".1%")


def parallel_saving_once_done(lengths: list[tuple[int, int]], block_size: int, width: int) -> float:
    """The saving of ``width`` parallel samples once every token is generated: they share exactly
    their prompt's full blocks (the partial last one is copied on the first write)."""
    shared = sum((width - 1) * (p // block_size) for p, _ in lengths)
    return shared / sum(width * blocks_for(p + o, block_size) for p, o in lengths)


def print_sharing(result: SharingResult, console: Console) -> None:
    """Both experiments' tables and the checks."""
    from pagedkv.models import BUILTIN_NOTE

    engine = result.config.engine
    model = BUILTIN_NOTE if engine.model is None else engine.model
    console.print(
        f"[bold]KV sharing in the live engine[/] -- {model}; block size {engine.run_block_size}"
        + (f" (every length / {engine.scale})" if engine.scale > 1 else "")
        + ". KV use is sampled while each forward pass runs; averages are per engine step."
    )
    checks = []
    if result.prefix:
        print_prefix(result, console)
        checks.append(("greedy outputs identical with prefix caching on and off", result.outputs_identical))
    checks.append(("every block back in the pool after each run", result.blocks_returned))
    if result.forks:
        print_forks(result, console)
        widths = sorted({r.width for r in result.forks})
        beats = all(result.fork("beam", w).saving > result.fork("parallel", w).saving for w in widths)
        checks.append(("beams save more than parallel samples at every width", beats))
    print_checks(console, checks)


def print_prefix(result: SharingResult, console: Console) -> None:
    first, warm = result.prefix[0], result.config.warm
    # Two narrow tables rather than one wide one: they must read in an 80-column terminal.
    memory = table(
        f"Shared system prompt: N requests of S common + {first.user_len} unique prompt tokens, "
        f"{first.output_len} greedy output tokens, all submitted at once"
        + (" after one warm-up request" if warm else "")
        + "; prefix caching on / off -- KV blocks held",
        ("S", "N", "peak on/off", "saved", "mean on/off"),
        left=0,
    )
    compute = table(
        "... and the prefill work",
        ("S", "N", "computed on/off", "skipped", "cold", "TTFT on/off (s)", "same output"),
        left=0,
        caption="cold: requests that computed the prefix themselves; TTFT: each engine's own clock",
    )
    for p in result.prefix:
        on, off, size = p.on, p.off, (str(p.prefix_len), str(p.num_requests))
        memory.add_row(
            *size,
            f"{on.peak_blocks}/{off.peak_blocks}",
            _pct(p.blocks_saved),
            f"{on.mean_blocks:.0f}/{off.mean_blocks:.0f}",
        )
        compute.add_row(
            *size,
            f"{on.prefill_computed}/{off.prefill_computed}",
            str(on.prefill_skipped),
            f"{p.cold_requests}/{p.num_requests}",
            f"{on.ttft_mean:.2f}/{off.ttft_mean:.2f}",
            "yes" if p.outputs_identical else "[red]NO[/]",
        )
    console.print(memory)
    console.print(compute)
    if not warm:
        console.print(
            "The requests admitted in the first step all compute the prefix ('cold'): a block is offered "
            "to other requests once a step has computed it; --warm shows a server that has seen the prompt."
        )


def print_forks(result: SharingResult, console: Console) -> None:
    config = result.config
    lengths, bs = config.fork_lengths(), config.engine.run_block_size
    paper = PAPER_SAVING[config.mix]
    means = f"{mean([p for p, _ in lengths]):.0f} prompt + {mean([o for _, o in lengths]):.0f} output tokens"
    forks = table(
        f"Parallel sampling and beam search: {config.num_prompts} '{config.mix}' prompts (mean {means}), "
        "KV blocks shared (copy-on-write) vs each sample or beam a private copy",
        ("mode", "n/width", "peak shared/private", "saved", "at peak", "once done", "paper"),
        caption="saved = 1 - blocks held / blocks without sharing, time-averaged over engine steps; "
        "once done: parallel samples at their final lengths; paper: the PagedAttention paper's range",
    )
    for run in result.forks:
        low, high = paper[run.kind]
        once_done = parallel_saving_once_done(lengths, bs, run.width) if run.kind == "parallel" else math.nan
        forks.add_row(
            "samples" if run.kind == "parallel" else "beams",
            str(run.width),
            f"{run.peak_blocks}/{run.peak_blocks_without_sharing}",
            _pct(run.saving),
            _pct(run.peak_saving),
            _pct(once_done),
            f"{low:.1%}-{high:.1%}",
        )
    console.print(forks)
    console.print(
        "Parallel samples share only their prompt's full blocks; beams also share what they generated "
        "(a beam chosen twice forks, a dropped beam's blocks go back at once). The paper measured OPT-13B "
        f"serving a stream of {config.mix}-length requests; here one batch runs with ignore_eos."
    )


def write_sharing_plots(result: SharingResult, out_dir: str | Path) -> list[Path]:
    """The figures of the experiments that ran, in ``out_dir``; their paths."""
    from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

    from pagedkv.plotting import new_figure, save, write_figures

    def panels(columns: int, title: str) -> tuple:
        fig = new_figure(5 * columns, 4.5)
        fig.suptitle(title, fontsize=11)
        return fig, list(fig.subplots(1, columns))

    def plot_prefix(result: SharingResult, path: Path) -> Path:
        first = result.prefix[0]
        fig, axes = panels(
            3,
            f"Shared system prompt: N requests of S common + {first.user_len} unique tokens, "
            f"{first.output_len} output tokens, all at once"
            + (" after a warm-up request" if result.config.warm else ""),
        )
        by_prefix: dict[int, list[PrefixPoint]] = {}
        for point in sorted(result.prefix, key=lambda p: p.num_requests):
            by_prefix.setdefault(point.prefix_len, []).append(point)
        figures = (
            ("peak KV blocks held", lambda run: run.peak_blocks),
            ("prefill tokens computed", lambda run: run.prefill_computed),
            ("mean time to first token (s)", lambda run: run.ttft_mean),
        )
        for ax, (ylabel, value) in zip(axes, figures, strict=True):
            for color, (prefix_len, points) in zip(
                PREFIX_COLORS * 4, sorted(by_prefix.items()), strict=False
            ):
                x = [p.num_requests for p in points]
                ax.plot(
                    x, [value(p.on) for p in points], "o-", color=color, label=f"S={prefix_len}, caching on"
                )
                ax.plot(
                    x,
                    [value(p.off) for p in points],
                    "s--",
                    color=color,
                    label=f"S={prefix_len}, caching off",
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sorted({p.num_requests for p in result.prefix}))
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_formatter(ScalarFormatter())
                axis.set_minor_formatter(NullFormatter())
            ax.set(xlabel="concurrent requests N", ylabel=ylabel)
            ax.grid(alpha=0.3, which="both")
        axes[0].legend(fontsize=8)
        return save(fig, path, dpi=110)

    def plot_forks(result: SharingResult, path: Path) -> Path:
        config = result.config
        fig, (bars, timeline) = panels(
            2,
            f"Parallel sampling and beam search on {config.num_prompts} '{config.mix}' prompts: "
            "KV blocks shared (copy-on-write) vs each sequence a private copy",
        )
        widths = sorted({r.width for r in result.forks})
        kinds = [k for k in KIND_COLORS if any(r.kind == k for r in result.forks)]
        step = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            x = [j + (i - (len(kinds) - 1) / 2) * step for j in range(len(widths))]
            values = [100 * result.fork(kind, w).saving for w in widths]
            bars.bar(x, values, step * 0.9, color=KIND_COLORS[kind], label=f"{KIND_LABELS[kind]}, measured")
            for xi, v in zip(x, values, strict=True):
                bars.annotate(f"{v:.1f}%", (xi, v), ha="center", va="bottom", fontsize=8)
            low, high = PAPER_SAVING[config.mix][kind]
            bars.axhspan(
                100 * low,
                100 * high,
                color=KIND_COLORS[kind],
                alpha=0.15,
                label=f"{KIND_LABELS[kind]}, paper",
            )
        bars.set_xticks(range(len(widths)), [str(w) for w in widths])
        bars.set(xlabel="samples n / beam width", ylabel="KV memory saved, time-averaged (%)")
        bars.legend(fontsize=8, loc="upper left")
        bars.grid(alpha=0.3, axis="y")
        shown = 4 if 4 in widths else widths[-1]
        runs = [result.fork(kind, shown) for kind in kinds]
        for run in runs:
            label = f"{KIND_LABELS[run.kind]}: held (shared)"
            timeline.plot([s.used_blocks for s in run.samples], color=KIND_COLORS[run.kind], label=label)
        private = [[s.table_blocks for s in run.samples] for run in runs]
        if all(p == private[0] for p in private):  # equal lengths and widths: one line serves both
            timeline.plot(private[0], "--", color="gray", label="either: each sequence a private copy")
        else:
            for run, blocks in zip(runs, private, strict=True):
                label = f"{KIND_LABELS[run.kind]}: each sequence a private copy"
                timeline.plot(blocks, "--", color=KIND_COLORS[run.kind], label=label)
        timeline.xaxis.set_major_locator(MaxNLocator(integer=True))
        timeline.set_title(f"width {shown}: blocks over the batch", fontsize=10)
        timeline.set(xlabel="engine step", ylabel="KV blocks")
        timeline.set_ylim(bottom=0)
        timeline.legend(fontsize=8)
        timeline.grid(alpha=0.3)
        return save(fig, path, dpi=110)

    figures = {}
    if result.prefix:
        figures["sharing_prefix.png"] = plot_prefix
    if result.forks:
        figures["sharing_fork.png"] = plot_forks
    return write_figures(result, out_dir, figures)
