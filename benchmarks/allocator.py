"""Thin entry point: the benchmark is :mod:`pagedkv.bench.allocator` (its docstring lists the options)."""

from pagedkv.bench.allocator import main

if __name__ == "__main__":
    main()
