"""``pagedkv bench sharing`` on the command line, and its section of ``pagedkv demo``.

The measurement modules import torch; this one does not, so building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from pagedkv.bench import MIXES
from pagedkv.cli_args import add_report_options

# -- command line --------------------------------------------------------------------------------
PARTS = ("all", "prefix", "fork")


def add_bench_sharing_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``sharing`` under ``pagedkv bench``."""
    parser = bench_subparsers.add_parser(
        "sharing",
        help="KV memory saved by block sharing in the live engine: shared prefixes, samples, beams",
        description="Measure, in the live engine, the KV blocks that sharing saves: N requests with a "
        "common system prompt with prefix caching on vs off (blocks held, prefill tokens computed and "
        "skipped, time to first token, identical greedy outputs), and parallel sampling and beam search "
        "(blocks held with copy-on-write sharing vs each sample or beam a private copy), next to the "
        "PagedAttention paper's figures; write plots.",
    )
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
    run = parser.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    run.add_argument(
        "--scale", type=int, default=1, help="divide every length, the block size and the step budget by this"
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=None, help="HF model folder (default: the built-in tiny Llama)")
    engine.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    engine.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default: 2048)"
    )
    engine.add_argument("--attention-backend", default=None, help="torch, cpu or triton (default: by device)")
    add_report_options(parser)
    parser.set_defaults(run=_run_bench_sharing, parser=parser)
    return parser


def _run_bench_sharing(args: argparse.Namespace) -> int:
    from pagedkv.bench.sharing import EngineOptions, ForkConfig, PrefixConfig, run_sharing
    from pagedkv.bench.sharing_report import print_sharing

    try:
        options = EngineOptions(
            model=args.model,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            scale=args.scale,
        )
        prefix_config = fork_config = None
        if args.part in ("all", "prefix"):
            prefix_config = PrefixConfig(
                prefix_lens=tuple(args.prefix_lens),
                num_requests=tuple(args.num_requests),
                user_len=args.user_len,
                output_len=args.output_len,
                warm=args.warm,
                seed=args.seed,
            )
            for s in prefix_config.prefix_lens:
                prefix_config.lengths(s, options.scale)
        if args.part in ("all", "fork"):
            fork_config = ForkConfig(
                mix=args.mix, num_prompts=args.num_prompts, widths=tuple(args.widths), seed=args.seed
            )
    except ValueError as err:
        args.parser.error(str(err))
    result = run_sharing(options, prefix_config, fork_config, progress=sys.stderr.isatty())
    if not args.no_plots:
        _write_plots(result, args.out)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        console = Console()
        print_sharing(result, console)
        _print_plot_paths(result, console)
    return 0 if result.ok else 1


def _write_plots(result, out: Path) -> None:
    from pagedkv.bench.sharing_plots import write_sharing_plots  # matplotlib: only when plotting

    result.plots = write_sharing_plots(result, out)


def _print_plot_paths(result, console: Console) -> None:
    for path in result.plots:
        console.print(f"  plot: {path}")


def run_sharing_demo(console: Console, out_dir: str | Path, seed: int = 0):
    """The ``pagedkv demo`` section: 4 and 16 requests sharing a 256-token system prompt after a
    warm-up request, and eight Alpaca-like prompts as four samples and four beams (~10 s on 2 cores)."""
    from pagedkv.bench.sharing import EngineOptions, ForkConfig, PrefixConfig, run_sharing
    from pagedkv.bench.sharing_report import print_sharing

    result = run_sharing(
        EngineOptions(),
        PrefixConfig(prefix_lens=(256,), num_requests=(4, 16), output_len=8, warm=True, seed=seed),
        ForkConfig(num_prompts=8, widths=(4,), seed=seed),
        progress=sys.stderr.isatty(),
    )
    _write_plots(result, Path(out_dir))
    print_sharing(result, console)
    _print_plot_paths(result, console)
    return result
