"""The simulator's results as terminal tables (rich)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from pagedkv.sim.breakdown import WASTE_CATEGORIES
from pagedkv.sim.simulate import SimResult
from pagedkv.sim.snapshot import ALLOCATORS

#: How allocators are labelled for people (tables and plots).
LABELS = {"max": "naive (Max)", "pow2": "Pow2", "oracle": "Oracle", "paged": "paged"}
#: ... and coloured, in the plots and the HTML replay alike.
ALLOCATOR_COLORS = {"max": "#d62728", "pow2": "#ff7f0e", "oracle": "#9467bd", "paged": "#2ca02c"}
CATEGORY_LABELS = {
    "token_states": "token states",
    "reservation": "reservation",
    "internal_fragmentation": "internal frag.",
    "external_fragmentation": "external frag.",
    "free": "free",
}


def human_bytes(n: float) -> str:
    """Binary units, except for whole decimal gigabytes (GPU sizes are sold as '80GB')."""
    if n >= 10**9 and n % 10**9 == 0:
        return f"{n // 10**9:.0f} GB"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def print_report(result: SimResult, console: Console) -> None:
    cfg = result.config
    spec = cfg.stored_kv_spec
    bpt = spec.bytes_per_token
    console.rule(f"[bold]pagedkv simulate[/] -- workload {cfg.workload}, seed {cfg.seed}")
    console.print(
        f"KV cache: {human_bytes(bpt)} per token ({spec.num_layers} layers x "
        f"{spec.num_kv_heads} KV heads x {spec.head_dim} dims, {spec.dtype}"
        f"{' + a float32 scale per token and head' if spec.scale_bytes else ''}); "
        f"KV memory {human_bytes(cfg.kv_memory)} = {human_bytes(cfg.gpu_memory)} GPU - "
        f"{human_bytes(cfg.weights_memory)} weights = {cfg.kv_slots:,} token slots; "
        f"block size {cfg.block_size}, max_seq_len {cfg.max_seq_len}."
    )
    ex = result.example
    console.print(
        f"\n[bold]Worked example[/]: requests of {', '.join(map(str, ex.lengths))} tokens at a "
        f"{ex.max_seq_len:,}-token context reserve [red]{ex.naive_slots:,}[/] slots contiguously "
        f"({human_bytes(ex.naive_slots * bpt)}) and [green]{ex.paged_slots:,}[/] slots paged "
        f"({human_bytes(ex.paged_slots * bpt)}): [bold]{ex.ratio:.0f}x[/] less."
    )
    _print_batches(result, console)
    _print_breakdown(result, console)
    _print_trace(result, console)
    _print_block_sizes(result, console)
    _print_prefix_and_capacity(result, console)
    _print_hybrid(result, console)


def _table(title: str, first: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", title_style="bold")
    table.add_column(first, no_wrap=True)
    return table


def _print_batches(result: SimResult, console: Console) -> None:
    bpt = result.config.stored_kv_spec.bytes_per_token
    snaps = result.snapshots
    reserved = _table("(a) N requests in flight: KV memory reserved, GiB (mean over the moments)", "N =")
    util = _table("    utilization: token states / reserved memory", "N =")
    for table in (reserved, util):
        for snap in snaps:
            table.add_column(str(snap.batch_size), justify="right")
    reserved.add_row(
        "token states", *(f"{s.breakdowns['paged'].token_states * bpt / 2**30:.1f}" for s in snaps)
    )
    for name in ALLOCATORS:
        reserved.add_row(LABELS[name], *(f"{s.breakdowns[name].reserved * bpt / 2**30:.1f}" for s in snaps))
        util.add_row(LABELS[name], *(_pct(s.breakdowns[name].utilization) for s in snaps))
    console.print(reserved, util)


def _print_breakdown(result: SimResult, console: Console) -> None:
    n = result.config.sweep_batch_size
    snap = next((s for s in result.snapshots if s.batch_size == n), result.snapshots[-1])
    table = _table(
        f"Where the reserved memory goes at N={snap.batch_size} (Figure 2 of the paper)", "allocator"
    )
    for key in ("token_states", *WASTE_CATEGORIES):
        table.add_column(CATEGORY_LABELS[key], justify="right")
    for name in ALLOCATORS:
        fractions = snap.breakdowns[name].fractions()
        table.add_row(LABELS[name], *(_pct(fractions[k]) for k in ("token_states", *WASTE_CATEGORIES)))
    console.print(table)


def _print_trace(result: SimResult, console: Console) -> None:
    cfg = result.config
    memory = _table(
        f"(b) Dynamic trace: {cfg.trace_steps:,} steps, Poisson arrivals at {result.arrival_rate:.3f} "
        f"requests/step (offered load ~{cfg.trace_concurrency} in flight), "
        f"{human_bytes(cfg.kv_memory)} of KV memory; time-averaged shares of that memory",
        "allocator",
    )
    for header in ("tokens", "reserv.", "int. frag.", "ext. frag.", "free", "util."):
        memory.add_column(header, justify="right")
    requests = _table("    requests", "allocator")
    for header in ("peak running", "mean running", "completed", "preempted"):
        requests.add_column(header, justify="right")
    for name, run in result.trace.items():
        fractions = run.breakdown.fractions()
        memory.add_row(
            LABELS[name], *(_pct(fractions[k]) for k in CATEGORY_LABELS), _pct(run.breakdown.utilization)
        )
        requests.add_row(
            LABELS[name],
            str(run.peak_running),
            f"{run.mean_running:.1f}",
            str(run.completed),
            str(run.preemptions),
        )
    console.print(memory)
    console.print(
        "    util. = token states / memory not idle (held slots, and free holes while a request waits)"
    )
    console.print(requests)


def _print_block_sizes(result: SimResult, console: Console) -> None:
    table = _table(f"(c) Block size trade-off at N={result.config.sweep_batch_size}", "block size")
    for col in ("wasted slots", "waste", "table entries"):
        table.add_column(col, justify="right")
    for row in result.block_sizes:
        mark = " *" if row.block_size == result.config.block_size else ""
        table.add_row(
            f"{row.block_size}{mark}",
            f"{row.wasted_slots:,.0f}",
            _pct(row.waste_fraction),
            f"{row.table_entries:,.0f}",
        )
    console.print(table)


def _print_prefix_and_capacity(result: SimResult, console: Console) -> None:
    bpb = result.config.stored_kv_spec.bytes_per_block(result.config.block_size)
    px = result.prefix
    console.print(
        f"\n[bold](d) Prefix sharing[/]: {px.num_requests} requests with a {px.prefix_len}-token system "
        f"prompt: {human_bytes(px.blocks_without_sharing * bpb)} without sharing, "
        f"{human_bytes(px.blocks_with_sharing * bpb)} with shared blocks "
        f"({_pct(1 - px.blocks_with_sharing / px.blocks_without_sharing)} saved); "
        f"{px.shared_blocks} full prompt blocks are held once, and writing into the shared partial "
        f"block cost {px.cow_copies} copy-on-write block copies (one per request but the last)."
    )
    fits = result.capacity
    naive = fits["max"]
    console.print(
        f"[bold](e) Capacity[/] in {human_bytes(result.config.kv_memory)} of KV memory: "
        + ", ".join(f"{LABELS[k]} {v:,}" for k, v in fits.items())
        + f" concurrent requests -> paged fits [bold]{fits['paged'] / naive:.1f}x[/] the naive count."
    )


def _print_hybrid(result: SimResult, console: Console) -> None:
    """Experiment (g), when the model has sliding-window layers."""
    hy = result.hybrid
    if hy is None:
        return
    table = _table(
        f"(g) Sliding windows in {human_bytes(result.config.kv_memory)}: hybrid paging (a block "
        f"{hy.block_layers['hybrid']} layers deep) at its fill",
        "KV group",
    )
    for column in ("attends over", "layers", "blocks held", "handed back as the window passed"):
        table.add_column(column, justify="right")
    for g, group in enumerate(hy.groups):
        window = "the whole context" if group.window is None else f"window {group.window:,}"
        expired = "" if group.window is None else f"{group.expired_blocks:,}"
        table.add_row(str(g), window, str(group.layers), f"{group.held_blocks:,}", expired)
    console.print(table)
    console.print(
        f"Requests held at once: hybrid paging [green]{hy.requests['hybrid']:,}[/] "
        f"({_pct(hy.used_blocks['hybrid'] / hy.pool_blocks['hybrid'])} of its blocks in use), whole "
        f"context (every layer every token) [red]{hy.requests['whole']:,}[/] "
        f"({_pct(hy.used_blocks['whole'] / hy.pool_blocks['whole'])}) -> [bold]{hy.ratio:.2f}x[/]."
    )
