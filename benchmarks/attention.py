"""Thin entry point: the benchmark is :mod:`pagedkv.bench.attention` (its docstring lists the options)."""

from pagedkv.bench.attention import main

if __name__ == "__main__":
    main()
