"""``pagedkv bench sharing`` on the command line, and its section of ``pagedkv demo``.

The measurement modules import torch; this one does not, so building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from pagedkv.bench.driver import EngineOptions, add_run_options
from pagedkv.bench.sharing_config import MIXES, ForkConfig, PrefixConfig
from pagedkv.cli_args import (
    ReportOptions,
    add_command,
    add_engine_options,
    add_report_options,
    config_from_args,
    show_report,
    usage_errors,
)

PARTS = ("all", "prefix", "fork")
#: The engine options a sharing run lets users change (pool sizes and caching are its own).
ENGINE_FIELDS = ("model", "dtype", "block_size", "max_num_batched_tokens", "attention_backend")


def add_bench_sharing_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """KV memory saved by block sharing in the live engine: shared prefixes, samples, beams

    Measure, in the live engine, the KV blocks that sharing saves: N requests with a common system
    prompt with prefix caching on vs off (blocks held, prefill tokens computed and skipped, time to
    first token, identical greedy outputs), and parallel sampling and beam search (blocks held with
    copy-on-write sharing vs each sample or beam a private copy), next to the PagedAttention
    paper's figures; write plots.
    """
    parser = add_command(bench_subparsers, "sharing", _run_bench_sharing, add_bench_sharing_parser.__doc__)
    parser.add_argument("--part", choices=PARTS, default="all", help="experiments to run (default: all)")
    prefix = parser.add_argument_group("shared system prompt")
    prefix.add_argument(
        "--prefix-lens",
        type=int,
        nargs="+",
        default=[256, 1024],
        help="common prefix lengths S (default: 256 1024)",
    )
    prefix.add_argument(
        "--num-requests",
        type=int,
        nargs="+",
        default=[1, 4, 16, 64],
        help="request counts N (default: 1 4 16 64)",
    )
    prefix.add_argument(
        "--user-len", type=int, default=32, help="unique prompt tokens per request (default: 32)"
    )
    prefix.add_argument("--output-len", type=int, default=16, help="greedy output tokens (default: 16)")
    prefix.add_argument(
        "--warm", action="store_true", help="send one request with the system prompt first (steady state)"
    )
    fork = parser.add_argument_group("parallel sampling and beam search")
    fork.add_argument(
        "--mix", choices=MIXES, default="alpaca", help="prompt/output length mix (default: alpaca)"
    )
    fork.add_argument("--num-prompts", type=int, default=16, help="prompts in the batch (default: 16)")
    fork.add_argument(
        "--widths", type=int, nargs="+", default=[2, 4, 6], help="samples n and beam widths (default: 2 4 6)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    add_run_options(parser)
    add_engine_options(parser, ENGINE_FIELDS)
    add_report_options(parser)
    return parser


def _run_bench_sharing(args: argparse.Namespace) -> int:
    from pagedkv.bench.sharing import run_sharing

    options = EngineOptions.from_args(args)
    prefix_config = fork_config = None
    if args.part in ("all", "prefix"):
        tuples = {"prefix_lens": tuple(args.prefix_lens), "num_requests": tuple(args.num_requests)}
        prefix_config = config_from_args(PrefixConfig, args, **tuples)
        with usage_errors(args):
            for s in prefix_config.prefix_lens:
                prefix_config.lengths(s, options.scale)
    if args.part in ("all", "fork"):
        fork_config = config_from_args(ForkConfig, args, widths=tuple(args.widths))
    result = run_sharing(options, prefix_config, fork_config, progress=sys.stderr.isatty())
    show_report(args, result, _write_plots, _print_sharing)
    return 0 if result.ok else 1


def _write_plots(result, out: Path) -> list[Path]:
    from pagedkv.bench.sharing_plots import write_sharing_plots  # matplotlib: only when plotting

    return write_sharing_plots(result, out)


def _print_sharing(result, console: Console) -> None:
    from pagedkv.bench.sharing_report import print_sharing

    print_sharing(result, console)


def run_sharing_demo(console: Console, out_dir: str | Path, seed: int = 0):
    """The ``pagedkv demo`` section: 4 and 16 requests sharing a 256-token system prompt after a
    warm-up request, and eight Alpaca-like prompts as four samples and four beams (~10 s on 2 cores)."""
    from pagedkv.bench.sharing import run_sharing

    result = run_sharing(
        EngineOptions(),
        PrefixConfig(prefix_lens=(256,), num_requests=(4, 16), output_len=8, warm=True, seed=seed),
        ForkConfig(num_prompts=8, widths=(4,), seed=seed),
        progress=sys.stderr.isatty(),
    )
    result.plots = show_report(ReportOptions(Path(out_dir)), result, _write_plots, _print_sharing, console)
    return result
