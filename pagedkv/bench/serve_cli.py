"""``pagedkv bench serve`` on the command line: options, and a server of its own when no URL is given."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from pagedkv.cli_args import add_command, add_engine_options, build_engine, config_from_args, positive_int
from pagedkv.server.cli import API_KEY_ENV


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be > 0 (or inf), got {text!r}")
    return value


def add_bench_serve_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """serving benchmark: a seeded workload at a Poisson rate against an OpenAI server

    Send --num-prompts streaming completions, arriving at --request-rate per second (Poisson; inf =
    all at once), to --base-url, or to a server started in this process when no URL is given.
    Reports request and token throughput, TTFT and inter-token latency percentiles, and the
    server's peak KV-cache usage.
    """
    parser = add_command(bench_subparsers, "serve", run_bench_serve, add_bench_serve_parser.__doc__)
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: start one)"
    )
    target.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"default: ${API_KEY_ENV}")
    target.add_argument(
        "--served-model-name", default=None, help="model name to request (default: the server's first)"
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-prompts", type=positive_int, default=100, help="requests (default: 100)")
    workload.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests per second, or inf (default: inf)"
    )
    workload.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="most requests in flight (default: no cap)",
    )
    workload.add_argument(
        "--input-len", type=positive_int, default=64, help="prompt length in words (default: 64)"
    )
    workload.add_argument(
        "--output-len", type=positive_int, default=32, help="tokens to generate per request (default: 32)"
    )
    workload.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths vary uniformly within +-ratio of --input-len/--output-len (default: 0)",
    )
    workload.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    rival = parser.add_argument_group("side by side with vLLM")
    rival.add_argument(
        "--vllm-python",
        default=None,
        help="python of a virtual environment with vLLM's CPU build: run the workload against "
        "`pagedkv serve` and vLLM's OpenAI server, each in its own process on --model, and print both",
    )
    rival.add_argument(
        "--threads", type=positive_int, default=None, help="CPU threads of each server (default: all)"
    )
    rival.add_argument(
        "--log-dir", default="bench-serve-logs", help="where the servers' logs go (default: %(default)s)"
    )
    add_engine_options(parser)
    return parser


def run_bench_serve(args: argparse.Namespace) -> int:
    import httpx

    from pagedkv.bench.serve import BenchConfig, print_report, run_benchmark

    config = config_from_args(BenchConfig, args, model=args.served_model_name)
    if args.vllm_python is not None:
        return _run_against_vllm(args, config)
    if args.base_url is not None:
        try:
            result = run_benchmark(args.base_url, config)
        except httpx.HTTPError as err:
            print(f"error: the server at {args.base_url} failed: {err}", file=sys.stderr)
            return 1
    else:
        from pagedkv.server.app import create_app
        from pagedkv.server.runner import ServerThread

        app = create_app(build_engine(args), api_key=args.api_key, max_waiting=None)
        with ServerThread(app) as server:
            result = run_benchmark(server.base_url, config)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_report(result)
    return 0 if result.failed == 0 else 1


def _run_against_vllm(args: argparse.Namespace, config) -> int:
    from pathlib import Path

    import torch

    from pagedkv.bench.serve_rivals import ServedModel, compare_servers, comparison_rows, print_comparison

    if args.model is None or args.base_url is not None:
        args.parser.error(
            "--vllm-python needs --model (a Hugging Face folder both servers load) and no --base-url"
        )
    dtype = "float32" if args.dtype == "auto" else args.dtype  # vLLM's auto follows the checkpoint
    served = ServedModel(args.model, dtype, args.max_num_seqs, args.threads or torch.get_num_threads())
    results = compare_servers(config, served, args.vllm_python, Path(args.log_dir))
    if args.json:
        document = {name: result.to_json() for name, result in results.items()}
        print(json.dumps(document | {"comparison": comparison_rows(results)}, indent=2))
    else:
        print_comparison(results)
    return 0 if all(result.failed == 0 for result in results.values()) else 1
