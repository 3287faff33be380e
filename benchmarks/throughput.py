"""Thin entry point for ``pagedkv bench throughput`` (:mod:`pagedkv.bench.throughput_cli`): the same options.

.venv/bin/python benchmarks/throughput.py [--engines ...] [--vllm-python PATH] [--llamacpp-python PATH]
"""

import sys

from pagedkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
