"""Serving benchmark: a seeded workload at a Poisson rate against an OpenAI-compatible server.

    .venv/bin/python benchmarks/serve.py [--base-url http://127.0.0.1:8000] [--num-prompts 100]
        [--request-rate inf] [--input-len 64] [--output-len 32] [--seed 0] [--json]

The same as ``pagedkv bench serve``: without ``--base-url`` it starts a server in this process
(engine options as for ``pagedkv serve``). Prints request and token throughput, TTFT and
inter-token latency p50/p90/p99, and the server's peak KV-cache usage during the run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagedkv.server.cli import add_bench_serve_parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/serve.py")
    add_bench_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
