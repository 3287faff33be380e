"""``pagedkv bench parallel`` on the command line (no torch here: the parser stays fast)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from pagedkv.bench.driver import EngineOptions
from pagedkv.cli_args import add_command, add_engine_options, add_report_options, positive_int, show_report

#: The engine options a parallel run lets users change.
ENGINE_FIELDS = ("model", "dtype", "block_size", "max_num_batched_tokens", "attention_backend")


def add_bench_parallel_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """tensor parallelism: N ranks x T threads vs 1 rank x T threads, and the all-reduces' cost

    Run a prefill-heavy workload (long prompts, one new token) and a decode workload (short
    prompts, many new tokens) on one rank and on --tensor-parallel-size ranks, stepped in turn,
    greedy; print tokens/s of each, the speed-up, rank 0's collective calls and milliseconds per
    step, and whether the tokens agree. Default model: the throughput benchmark's Llama (hidden
    512, 6 layers, 8/4 heads, 32k vocabulary).
    """
    parser = add_command(bench_subparsers, "parallel", _run_bench_parallel, add_bench_parallel_parser.__doc__)
    what = parser.add_argument_group("what to run")
    what.add_argument("--tensor-parallel-size", type=positive_int, default=2, help="(default: %(default)s)")
    what.add_argument(
        "--threads", type=positive_int, default=1, help="threads per rank (default: %(default)s)"
    )
    what.add_argument(
        "--repeats", type=positive_int, default=3, help="runs per figure (default: %(default)s)"
    )
    what.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    shape = parser.add_argument_group("workloads: requests x prompt tokens + new tokens")
    shape.add_argument("--prefill", type=positive_int, nargs=3, default=[4, 512, 1], metavar=("R", "P", "N"))
    shape.add_argument("--decode", type=positive_int, nargs=3, default=[8, 16, 64], metavar=("R", "P", "N"))
    add_engine_options(parser, ENGINE_FIELDS)
    add_report_options(parser, plots=False, out_help="folder for the generated bench model")
    return parser


def _run_bench_parallel(args: argparse.Namespace) -> int:
    from pagedkv.bench.parallel import ParallelConfig, Workload, print_parallel, run_parallel
    from pagedkv.bench.throughput_model import bench_model_path

    model = Path(args.model) if args.model else bench_model_path(Path(args.out) / "models")
    config = ParallelConfig(
        model=model,
        engine=EngineOptions.from_args(args),
        workloads=(Workload("prefill", *args.prefill), Workload("decode", *args.decode)),
        threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        repeats=args.repeats,
        seed=args.seed,
    )
    result = run_parallel(config)
    show_report(args, result, None, print_parallel, Console())
    return 0 if result.ok else 1
