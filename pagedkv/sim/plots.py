"""The simulator's results as PNG figures (matplotlib, Agg canvas: no display needed; see
:mod:`pagedkv.plotting`)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.patches import Patch, Rectangle

from pagedkv.plotting import new_figure, save, write_figures
from pagedkv.sim.report import ALLOCATOR_COLORS, CATEGORY_LABELS, LABELS
from pagedkv.sim.simulate import SimResult
from pagedkv.sim.snapshot import ALLOCATORS

CATEGORY_COLORS = {
    "token_states": "#2ca02c",
    "reservation": "#fdae61",
    "internal_fragmentation": "#d7191c",
    "external_fragmentation": "#7b3294",
    "free": "#dddddd",
}
REQUEST_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def write_plots(result: SimResult, out_dir: str | Path) -> list[Path]:
    """Write every figure into ``out_dir`` (created if needed); return their paths."""
    figures = {
        "utilization_vs_batch.png": plot_utilization,
        "waste_breakdown.png": plot_waste_breakdown,
        "block_size_tradeoff.png": plot_block_sizes,
        "memory_map.png": plot_memory_map,
        "dynamic_trace.png": plot_trace,
    }
    if result.hybrid is not None:
        figures["kv_groups.png"] = plot_kv_groups
    return write_figures(result, out_dir, figures)


def plot_utilization(result: SimResult, path: Path) -> Path:
    fig = new_figure(7, 4.2)
    ax = fig.add_subplot()
    sizes = [s.batch_size for s in result.snapshots]
    for name in ALLOCATORS:
        util = [100 * s.breakdowns[name].utilization for s in result.snapshots]
        ax.plot(sizes, util, "o-", color=ALLOCATOR_COLORS[name], label=LABELS[name], linewidth=2)
        ax.annotate(f"{util[-1]:.0f}%", (sizes[-1], util[-1]), textcoords="offset points", xytext=(6, -3))
    ax.set_xlabel("requests in flight (N)")
    ax.set_ylabel("KV memory utilization (%)")
    ax.set_ylim(0, 105)
    ax.set_xlim(0, sizes[-1] * 1.12)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(0.0, 0.72))
    ax.set_title(f"Token states / reserved memory -- workload '{result.config.workload}'")
    return save(fig, path)


def _stacked(ax, names: list[str], fractions: list[dict[str, float]], categories: list[str]) -> None:
    bottoms = [0.0] * len(names)
    for cat in categories:
        values = [100 * f[cat] for f in fractions]
        ax.bar(
            names, values, bottom=bottoms, color=CATEGORY_COLORS[cat], label=CATEGORY_LABELS[cat], width=0.6
        )
        for i, v in enumerate(values):
            if v >= 4:
                ax.text(i, bottoms[i] + v / 2, f"{v:.0f}%", ha="center", va="center", fontsize=8)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylim(0, 100)
    ax.set_ylabel("%")


def plot_waste_breakdown(result: SimResult, path: Path) -> Path:
    fig = new_figure(11, 4.6)
    left, right = fig.subplots(1, 2)
    n = result.config.sweep_batch_size
    snap = next((s for s in result.snapshots if s.batch_size == n), result.snapshots[-1])
    names = [LABELS[a] for a in ALLOCATORS]
    _stacked(
        left,
        names,
        [snap.breakdowns[a].fractions() for a in ALLOCATORS],
        ["token_states", "reservation", "internal_fragmentation", "external_fragmentation"],
    )
    left.set_title(f"(a) {snap.batch_size} requests in flight: share of reserved memory")
    _stacked(right, names, [result.trace[a].breakdown.fractions() for a in ALLOCATORS], list(CATEGORY_COLORS))
    right.set_title("(b) dynamic trace: time-averaged share of the KV memory")
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return save(fig, path)


def plot_block_sizes(result: SimResult, path: Path) -> Path:
    fig = new_figure(7, 4.2)
    ax = fig.add_subplot()
    rows = result.block_sizes
    sizes = [r.block_size for r in rows]
    waste = ax.plot(
        sizes, [100 * r.waste_fraction for r in rows], "o-", color="#d7191c", label="wasted slots (%)"
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("wasted slots (% of held memory)", color="#d7191c")
    twin = ax.twinx()
    entries = twin.plot(
        sizes, [r.table_entries for r in rows], "s--", color="#2c7bb6", label="block-table entries"
    )
    twin.set_yscale("log")
    twin.set_ylabel("block-table entries (all requests)", color="#2c7bb6")
    ax.axvline(result.config.block_size, color="grey", linestyle=":", linewidth=1)
    ax.text(
        result.config.block_size,
        ax.get_ylim()[1] * 0.7,
        f" block size {result.config.block_size}",
        fontsize=8,
    )
    ax.grid(alpha=0.3)
    ax.legend(handles=waste + entries, loc="upper center")
    ax.set_title(f"Block size trade-off, {result.config.sweep_batch_size} requests in flight")
    return save(fig, path)


def plot_memory_map(result: SimResult, path: Path) -> Path:
    """Which request owns each slot: contiguous reservations vs paged blocks (worked example)."""
    ex = result.example
    bs = ex.block_size
    fig = new_figure(11, 5.6)
    top, middle, bottom = fig.subplots(3, 1, height_ratios=[1, 1, 2.6])
    names = [chr(ord("A") + i) for i in range(len(ex.lengths))]
    colors = [REQUEST_COLORS[i % len(REQUEST_COLORS)] for i in range(len(ex.lengths))]

    for (start, size), n, color in zip(ex.regions, ex.lengths, colors, strict=True):
        top.broken_barh([(start, n)], (0, 1), color=color)
        top.broken_barh(
            [(start + n, size - n)], (0, 1), facecolor=color, alpha=0.15, edgecolor=color, hatch="//"
        )
    top.set_title(
        f"contiguous: each request reserves max_seq_len = {ex.max_seq_len:,} slots -> "
        f"{ex.naive_slots:,} slots (solid: stored tokens, hatched: reserved, never used)",
        fontsize=9,
    )
    for i, ids in enumerate(ex.block_ids):
        middle.broken_barh([(block * bs, bs) for block in ids], (0, 1), color=colors[i])
    middle.set_title(f"paged, same scale: {ex.paged_slots:,} slots ({ex.ratio:.0f}x less)", fontsize=9)
    for ax in (top, middle):
        ax.set_xlim(0, ex.naive_slots)
        ax.set_yticks([])
        ax.set_xlabel("slot", fontsize=8)

    owner = {block: i for i, ids in enumerate(ex.block_ids) for block in ids}
    fill = {
        block: min(bs, ex.lengths[i] - j * bs)
        for i, ids in enumerate(ex.block_ids)
        for j, block in enumerate(ids)
    }
    num_blocks = max(owner) + 1
    for block in range(num_blocks):
        y = num_blocks - 1 - block
        for slot in range(bs):
            i = owner.get(block)
            used = i is not None and slot < fill[block]
            bottom.add_patch(
                Rectangle(
                    (slot, y),
                    0.92,
                    0.85,
                    facecolor=colors[i] if used else "white",
                    edgecolor=colors[i] if i is not None else "#bbbbbb",
                    hatch=None if used or i is None else "//",
                )
            )
        label = f"block {block}" + (f" ({names[owner[block]]})" if block in owner else "")
        bottom.text(-0.5, y + 0.42, label, ha="right", va="center", fontsize=8)
    bottom.set_xlim(-5, bs + 0.5)
    bottom.set_ylim(-0.2, num_blocks)
    bottom.axis("off")
    tables = "   ".join(
        f"{name} ({n} tokens): blocks {list(ids)}"
        for name, n, ids in zip(names, ex.lengths, ex.block_ids, strict=True)
    )
    bottom.set_title(f"paged pool, one row per {bs}-slot block -- block tables: {tables}", fontsize=9)
    bottom.legend(
        handles=[Patch(color=c, label=f"request {n}") for n, c in zip(names, colors, strict=True)]
        + [Patch(facecolor="white", edgecolor="grey", hatch="//", label="held, empty (last-block waste)")],
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=8,
    )
    return save(fig, path)


def plot_trace(result: SimResult, path: Path) -> Path:
    fig = new_figure(9, 4.2)
    ax = fig.add_subplot()
    for name, run in result.trace.items():
        ax.plot(
            run.running, color=ALLOCATOR_COLORS[name], label=f"{LABELS[name]} ({run.completed} completed)"
        )
    ax.axhline(result.config.trace_concurrency, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step (one token per running request)")
    ax.set_ylabel("requests running")
    ax.set_title(
        f"Dynamic trace: Poisson arrivals, offered load ~{result.config.trace_concurrency} in flight, "
        "fixed KV memory"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower center", ncol=2)
    return save(fig, path)


def plot_kv_groups(result: SimResult, path: Path) -> Path:
    """(g): the KV memory at each setting's fill, by who holds it -- whole context: the requests;
    hybrid paging: the full-attention groups and the sliding ones -- and the requests held."""
    hy = result.hybrid
    assert hy is not None
    fig = new_figure(8.5, 4.2)
    ax = fig.add_subplot()
    pool = hy.pool_blocks["hybrid"]
    full = sum(g.held_blocks for g in hy.groups if g.window is None)
    sliding = sum(g.held_blocks for g in hy.groups if g.window is not None)
    bars = {
        "whole context": [("every layer", hy.used_blocks["whole"] / hy.pool_blocks["whole"], "#d62728")],
        "hybrid paging": [
            ("full-attention groups", full / pool, "#1f77b4"),
            ("sliding groups", sliding / pool, "#17becf"),
        ],
    }
    for i, parts in enumerate(bars.values()):
        bottom = 0.0
        for label, fraction, colour in parts:
            ax.bar(i, 100 * fraction, bottom=100 * bottom, color=colour, width=0.6, label=label)
            if fraction >= 0.04:
                ax.text(i, 100 * (bottom + fraction / 2), f"{100 * fraction:.0f}%", ha="center", fontsize=8)
            bottom += fraction
        setting = "whole" if i == 0 else "hybrid"
        ax.text(i, 100 * bottom + 2, f"{hy.requests[setting]} requests", ha="center", fontsize=9)
    ax.set_xticks(range(len(bars)), list(bars))
    ax.set_ylim(0, 112)
    ax.set_ylabel("KV memory in use (%)")
    windows = sorted({g.window for g in hy.groups if g.window is not None})
    ax.set_title(f"(g) sliding windows {', '.join(map(str, windows))}: {hy.ratio:.2f}x the requests")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return save(fig, path)
