"""Offline throughput against transformers, vLLM's CPU build and llama.cpp: a thin entry point.

    .venv/bin/python benchmarks/throughput.py [options of `pagedkv bench throughput`]

is ``pagedkv bench throughput`` (see ``--help`` and pagedkv/bench/throughput.py).
"""

import sys

from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
