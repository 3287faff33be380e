"""The capacity benchmark as PNG figures: KV utilization and concurrency over time, per policy.

The x axis is each policy's own clock. (Figures as everywhere: :mod:`pagedkv.plotting`.)
"""

from __future__ import annotations

import math
from pathlib import Path

from pagedkv.bench.capacity import CapacityResult, PolicyRun
from pagedkv.engine.kv_policy import CONTIGUOUS, CONTIGUOUS_ORACLE, PAGED
from pagedkv.plotting import new_figure, save, write_figures

POLICY_COLORS = {PAGED.name: "#2ca02c", CONTIGUOUS.name: "#d62728", CONTIGUOUS_ORACLE.name: "#9467bd"}
UTILIZATION_TARGET = 0.95


def write_capacity_plots(result: CapacityResult, out_dir: str | Path) -> list[Path]:
    """Write both figures into ``out_dir`` (created if needed); return their paths."""
    figures = {"capacity_utilization.png": plot_utilization, "capacity_concurrency.png": plot_concurrency}
    return write_figures(result, out_dir, figures)


def _axes(result: CapacityResult, title: str, ylabel: str):
    fig = new_figure(8, 5)
    ax = fig.add_subplot()
    config = result.config
    ax.set_title(
        f"{title}\n{config.num_requests} '{config.workload}' requests at t=0, "
        f"{config.num_kv_blocks} blocks x {config.run_block_size} tokens, "
        f"max_model_len {config.run_max_model_len}",
        fontsize=10,
    )
    ax.set_xlabel("time (s, each policy's own clock)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _once_full(value: float, fmt: str) -> str:
    return f"once full: {fmt.format(value)}" if math.isfinite(value) else "never full"


def _times(run: PolicyRun) -> list[float]:
    return [s.elapsed for s in run.samples]


def plot_utilization(result: CapacityResult, path: Path) -> Path:
    fig, ax = _axes(result, "KV utilization: token slots holding a token / slots held", "utilization (%)")
    for policy, run in result.runs.items():
        points = [(s.elapsed, 100 * run.utilization(s)) for s in run.samples if s.used_blocks]
        label = f"{policy} ({_once_full(run.utilization_full, '{:.1%}')})"
        ax.plot(*zip(*points, strict=True), color=POLICY_COLORS[policy], label=label, linewidth=1.5)
    ax.axhline(100 * UTILIZATION_TARGET, color="gray", linestyle=":", linewidth=1, label="95%")
    ax.set_ylim(0, 105)
    fig.legend(loc="outside lower center", ncols=2, fontsize=9)
    return save(fig, path)


def plot_concurrency(result: CapacityResult, path: Path) -> Path:
    fig, ax = _axes(result, "Concurrent running requests", "running requests")
    for policy, run in result.runs.items():
        color = POLICY_COLORS[policy]
        label = f"{policy} (peak {run.peak_running}, mean {_once_full(run.mean_running_full, '{:.1f}')})"
        ax.plot(_times(run), [s.running for s in run.samples], color=color, label=label, linewidth=1.5)
        ax.axhline(result.predicted[policy], color=color, linestyle="--", linewidth=1, alpha=0.8)
        ax.axhline(result.length_biased[policy], color=color, linestyle=":", linewidth=1.2, alpha=0.9)
    ax.plot([], [], color="gray", linestyle="--", label="simulator prediction (same colour)")
    ax.plot([], [], color="gray", linestyle=":", label="length-biased prediction (same colour)")
    ax.set_ylim(bottom=0)
    fig.legend(loc="outside lower center", ncols=2, fontsize=9)
    return save(fig, path)
