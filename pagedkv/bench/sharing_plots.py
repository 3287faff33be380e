"""The sharing benchmark as PNG figures: prefix caching on vs off, and fork sharing vs private
copies (figures as everywhere: :mod:`pagedkv.plotting`)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

from pagedkv.bench.sharing import PrefixPoint, SharingResult
from pagedkv.bench.sharing_config import PAPER_SAVING
from pagedkv.plotting import new_figure, save, write_figures

PREFIX_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
KIND_COLORS = {"parallel": "#1f77b4", "beam": "#ff7f0e"}
KIND_LABELS = {"parallel": "parallel sampling", "beam": "beam search"}


def write_sharing_plots(result: SharingResult, out_dir: str | Path) -> list[Path]:
    """Write the figures of the experiments that ran into ``out_dir``; return their paths."""
    figures = {}
    if result.prefix:
        figures["sharing_prefix.png"] = plot_prefix
    if result.forks:
        figures["sharing_fork.png"] = plot_forks
    return write_figures(result, out_dir, figures)


def _figure(columns: int, title: str) -> tuple[Figure, list]:
    fig = new_figure(5 * columns, 4.5)
    fig.suptitle(title, fontsize=11)
    return fig, list(fig.subplots(1, columns))


def plot_prefix(result: SharingResult, path: Path) -> Path:
    first = result.prefix[0]
    warm = result.prefix_config is not None and result.prefix_config.warm
    fig, axes = _figure(
        3,
        f"Shared system prompt: N requests of S common + {first.user_len} unique tokens, "
        f"{first.output_len} output tokens, all at once" + (" after a warm-up request" if warm else ""),
    )
    panels = [
        ("peak KV blocks held", lambda run: run.peak_blocks, True),
        ("prefill tokens computed", lambda run: run.prefill_computed, True),
        ("mean time to first token (s)", lambda run: run.ttft_mean, True),
    ]
    by_prefix: dict[int, list[PrefixPoint]] = {}
    for point in result.prefix:
        by_prefix.setdefault(point.prefix_len, []).append(point)
    for ax, (ylabel, value, log_y) in zip(axes, panels, strict=True):
        for color, (prefix_len, points) in zip(PREFIX_COLORS * 4, sorted(by_prefix.items()), strict=False):
            points = sorted(points, key=lambda p: p.num_requests)
            x = [p.num_requests for p in points]
            ax.plot(x, [value(p.on) for p in points], "o-", color=color, label=f"S={prefix_len}, caching on")
            ax.plot(
                x, [value(p.off) for p in points], "s--", color=color, label=f"S={prefix_len}, caching off"
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({p.num_requests for p in result.prefix}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        if log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("concurrent requests N")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    return save(fig, path, dpi=110)


def plot_forks(result: SharingResult, path: Path) -> Path:
    config = result.fork_config
    fig, (bars, timeline) = _figure(
        2,
        f"Parallel sampling and beam search on {config.num_prompts} '{config.mix}' prompts: "
        "KV blocks shared (copy-on-write) vs each sequence a private copy",
    )
    widths = sorted({r.width for r in result.forks})
    kinds = [k for k in KIND_COLORS if any(r.kind == k for r in result.forks)]
    step = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        runs = [result.fork(kind, w) for w in widths]
        x = [j + (i - (len(kinds) - 1) / 2) * step for j in range(len(widths))]
        values = [100 * r.saving for r in runs]
        bars.bar(x, values, step * 0.9, color=KIND_COLORS[kind], label=f"{KIND_LABELS[kind]}, measured")
        for xi, v in zip(x, values, strict=True):
            bars.annotate(f"{v:.1f}%", (xi, v), ha="center", va="bottom", fontsize=8)
        low, high = PAPER_SAVING[config.mix][kind]
        bars.axhspan(
            100 * low, 100 * high, color=KIND_COLORS[kind], alpha=0.15, label=f"{KIND_LABELS[kind]}, paper"
        )
    bars.set_xticks(range(len(widths)), [str(w) for w in widths])
    bars.set_xlabel("samples n / beam width")
    bars.set_ylabel("KV memory saved, time-averaged (%)")
    bars.legend(fontsize=8, loc="upper left")
    bars.grid(alpha=0.3, axis="y")
    shown = 4 if 4 in widths else widths[-1]
    runs = [result.fork(kind, shown) for kind in kinds]
    for run in runs:
        color, label = KIND_COLORS[run.kind], KIND_LABELS[run.kind]
        timeline.plot([s.used_blocks for s in run.samples], color=color, label=f"{label}: held (shared)")
    private = [[s.table_blocks for s in run.samples] for run in runs]
    if all(p == private[0] for p in private):  # equal lengths and widths: one line serves both
        timeline.plot(private[0], "--", color="gray", label="either: each sequence a private copy")
    else:
        for run, blocks in zip(runs, private, strict=True):
            label = f"{KIND_LABELS[run.kind]}: each sequence a private copy"
            timeline.plot(blocks, "--", color=KIND_COLORS[run.kind], label=label)
    timeline.xaxis.set_major_locator(MaxNLocator(integer=True))
    timeline.set_title(f"width {shown}: blocks over the batch", fontsize=10)
    timeline.set_xlabel("engine step")
    timeline.set_ylabel("KV blocks")
    timeline.set_ylim(bottom=0)
    timeline.legend(fontsize=8)
    timeline.grid(alpha=0.3)
    return save(fig, path, dpi=110)
