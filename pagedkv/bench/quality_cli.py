"""``pagedkv bench quality`` on the command line.

The measurement imports torch; this module does not, so building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedkv.bench.driver import EngineOptions
from pagedkv.bench.quality_config import QualityConfig
from pagedkv.cli_args import (
    add_command,
    add_engine_options,
    add_report_options,
    config_from_args,
    positive_int,
    show_report,
)
from pagedkv.memory.spec import KV_CACHE_DTYPE_NAMES

#: The engine options a quality run lets users change (the pool and the context are its own).
ENGINE_FIELDS = ("model", "dtype", "block_size", "max_num_batched_tokens", "attention_backend")
DEFAULTS = QualityConfig()


def add_bench_quality_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """KV cache dtype vs quality: held-out perplexity, greedy agreement and logits error against auto

    On the built-in model (trained on the Python standard library) and the stdlib files it never
    trained on, run one engine per KV cache dtype and compare each with auto: perplexity through
    the engine's prompt logprobs, the logits' max and mean absolute error on the same rows, and
    greedy continuations token by token. Prints a table and writes quality.json under --out.
    """
    parser = add_command(bench_subparsers, "quality", _run_bench_quality, add_bench_quality_parser.__doc__)
    what = parser.add_argument_group("what to compare")
    what.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        choices=KV_CACHE_DTYPE_NAMES,
        default=list(DEFAULTS.kv_cache_dtypes),
        help="KV cache dtypes; auto (the reference) always runs (default: %(default)s)",
    )
    what.add_argument(
        "--goal-pct",
        type=float,
        default=DEFAULTS.goal_pct,
        help="most perplexity rise over auto, in %% (exit status 1 above it) (default: %(default)s)",
    )
    text = parser.add_argument_group("held-out text")
    text.add_argument(
        "--max-heldout-chars",
        type=int,
        default=None,
        help="read held-out files up to this many characters (default: all, ~1.1 M characters, "
        "~345 k tokens)",
    )
    text.add_argument(
        "--window", type=int, default=DEFAULTS.window, help="perplexity window (default: %(default)s)"
    )
    text.add_argument(
        "--stride", type=int, default=None, help="window stride; smaller: sliding windows (default: --window)"
    )
    text.add_argument(
        "--logits-rows",
        type=int,
        default=DEFAULTS.logits_rows,
        help="logits rows compared (default: %(default)s)",
    )
    greedy = parser.add_argument_group("greedy agreement")
    greedy.add_argument(
        "--num-prompts", type=int, default=DEFAULTS.num_prompts, help="(default: %(default)s)"
    )
    greedy.add_argument("--prompt-len", type=int, default=DEFAULTS.prompt_len, help="(default: %(default)s)")
    greedy.add_argument(
        "--gen-tokens",
        type=int,
        default=DEFAULTS.gen_tokens,
        help="greedy tokens per prompt (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    add_engine_options(parser, ENGINE_FIELDS)
    add_report_options(parser, plots=False, out_help="folder for quality.json")
    return parser


def _run_bench_quality(args: argparse.Namespace) -> int:
    from pagedkv.bench.quality import run_quality
    from pagedkv.bench.quality_report import print_quality

    options = EngineOptions.from_args(args)
    config = config_from_args(QualityConfig, args, kv_cache_dtypes=tuple(args.kv_cache_dtypes))
    result = run_quality(options, config, progress=sys.stderr.isatty())
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "quality.json"
    saved.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    print(f"figures saved to {saved}", file=sys.stderr)
    show_report(args, result, None, print_quality)
    return 0 if result.ok else 1
