"""``pagedkv bench router`` on the command line: engine and workload options, then the table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

from pagedkv.cli_args import add_command, add_engine_options, engine_config, positive_int


def add_bench_router_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """replicas behind vllm-router: prefix-cache hit rate and TTFT per routing policy

    Start one replica with 2 x --num-kv-blocks, then two replicas with --num-kv-blocks each behind
    vllm-router (round_robin, cache_aware, kv_aware), and send each the same shared-prefix
    workload (--num-systems system prompts x --users-per-system users, shuffled, --concurrency
    clients). Prints each setup's prefix-cache hit rate (from the replicas' /metrics), its share of
    the single replica's, client-side TTFT and how the requests split between the replicas.
    """
    parser = add_command(bench_subparsers, "router", run_bench_router, add_bench_router_parser.__doc__)
    add_engine_options(parser, num_kv_blocks=48, max_model_len=256)
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-systems", type=positive_int, default=8, help="system prompts (default: 8)")
    workload.add_argument("--users-per-system", type=positive_int, default=32, help="default: 32")
    workload.add_argument("--system-words", type=positive_int, default=90, help="default: 90 (~128 tokens)")
    workload.add_argument(
        "--output-len", type=positive_int, default=4, help="tokens per request (default: 4)"
    )
    workload.add_argument(
        "--concurrency", type=positive_int, default=4, help="clients in flight (default: 4)"
    )
    workload.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the runs to this JSON file")
    return parser


def run_bench_router(args: argparse.Namespace) -> int:
    from pagedkv.bench.router import RouterWorkload, bench_router, format_runs

    workload = RouterWorkload(
        num_systems=args.num_systems,
        users_per_system=args.users_per_system,
        system_words=args.system_words,
        output_len=args.output_len,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    engine = engine_config(args)
    print(
        f"workload: {workload}\nper replica: {engine.num_kv_blocks} KV blocks of {engine.block_size}",
        file=sys.stderr,
    )
    runs = bench_router(engine, workload, log=subprocess.DEVNULL)
    print(format_runs(runs))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([dataclasses.asdict(run) for run in runs], out, indent=2)
    return 0
