"""Thin entry point: the benchmark is :mod:`pagedkv.bench.throughput` (its docstring lists the options)."""

from pagedkv.bench.throughput import main

if __name__ == "__main__":
    main()
