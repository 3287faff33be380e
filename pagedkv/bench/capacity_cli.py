"""``pagedkv bench capacity`` on the command line, and its section of ``pagedkv demo``.

The measurement imports torch; this module does not, so building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from pagedkv.bench.capacity_config import CAPACITY_MAX_NUM_SEQS, WORKLOADS, CapacityConfig
from pagedkv.bench.driver import EngineOptions, add_run_options
from pagedkv.cli_args import (
    ReportOptions,
    add_command,
    add_engine_options,
    add_report_options,
    config_from_args,
    show_report,
)

#: The engine options a capacity run lets users change (the KV budget and policy are its own, and
#: it runs without a prefix cache: see CapacityConfig.engine_config).
ENGINE_FIELDS = (
    "model",
    "dtype",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "decode_headroom",
    "attention_backend",
    "kv_cache_dtype",
)


def add_bench_capacity_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """paged vs contiguous KV reservation in the live engine: concurrency, utilization, throughput

    Run one seeded workload, all requests at once, under the paged, contiguous (max_model_len
    reserved per request) and contiguous-oracle (prompt + max_tokens) KV policies on the same model
    and KV budget, interleaved step by step; print the figures next to the simulator's prediction
    and write plots.
    """
    parser = add_command(bench_subparsers, "capacity", _run_bench_capacity, add_bench_capacity_parser.__doc__)
    run = parser.add_argument_group("workload and budget")
    run.add_argument(
        "--workload", choices=WORKLOADS, default="normal", help="length mix (default: %(default)s)"
    )
    run.add_argument("--num-requests", type=int, default=128, help="requests (default: %(default)s)")
    run.add_argument(
        "--kv-tokens", type=int, default=16 * 2048, help="KV budget in tokens (default: %(default)s)"
    )
    run.add_argument("--max-model-len", type=int, default=2048, help="context length (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    run.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of the workload; each step is timed by its fastest run (default: %(default)s)",
    )
    add_run_options(parser)
    add_engine_options(parser, ENGINE_FIELDS, max_num_seqs=CAPACITY_MAX_NUM_SEQS)
    add_report_options(parser)
    return parser


def _run_bench_capacity(args: argparse.Namespace) -> int:
    from pagedkv.bench.capacity import run_capacity

    config = config_from_args(CapacityConfig, args, engine=EngineOptions.from_args(args))
    result = run_capacity(config, progress=sys.stderr.isatty())
    show_report(args, result, _write_plots, _print_capacity)
    return 0 if all(run.blocks_returned for run in result.runs.values()) else 1


def _write_plots(result, out: Path) -> list[Path]:
    from pagedkv.bench.capacity_plots import write_capacity_plots  # matplotlib: only when plotting

    return write_capacity_plots(result, out)


def _print_capacity(result, console: Console) -> None:
    from pagedkv.bench.capacity_report import print_capacity

    print_capacity(result, console)


def run_capacity_demo(console: Console, out_dir: str | Path, seed: int = 0):
    """The ``pagedkv demo`` section: the benchmark at 1/8 scale with half the budget, three times
    (~6 s on 2 cores). One torch thread: a tiny model's steps gain little from a second one, and
    lose a lot when the machine is busy with anything else."""
    from pagedkv.bench.capacity import run_capacity

    engine = EngineOptions(max_num_seqs=CAPACITY_MAX_NUM_SEQS, scale=8, threads=1)
    config = CapacityConfig(num_requests=64, kv_tokens=8 * 2048, seed=seed, engine=engine, repeats=3)
    result = run_capacity(config, progress=sys.stderr.isatty())
    result.plots = show_report(ReportOptions(Path(out_dir)), result, _write_plots, _print_capacity, console)
    return result
