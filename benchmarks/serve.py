"""Thin entry point for ``pagedkv bench serve`` (:mod:`pagedkv.bench.serve_cli`): the same options.

.venv/bin/python benchmarks/serve.py [--base-url http://127.0.0.1:8000] [--num-prompts 100]
"""

import argparse
import sys

from pagedkv.bench.serve_cli import add_bench_serve_parser

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/serve.py")
    add_bench_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(args.func(args))
