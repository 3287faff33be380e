"""Resident memory after loading against what the engine must hold: weights + KV cache.

Issue 12 asks for at most 1.2x. Loads issue 12's bench model in a fresh process and prints how
much the RSS grew over the load, next to the weights' and the KV cache's bytes (packed oneDNN
weights count at their dense size)::

    .venv/bin/python benchmarks/resident_memory.py float32 auto   # dtype, linear kernel
"""

from __future__ import annotations

import sys
from pathlib import Path

import pagedkv.engine  # noqa: F401  (imported before the baseline is read)
from pagedkv import LLM
from pagedkv.bench.throughput_model import bench_model_path


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    dtype, kernel = (sys.argv[1:] + ["float32", "auto"][len(sys.argv) - 1 :])[:2]
    path = bench_model_path(Path("pagedkv-report"))
    before = rss_bytes()
    llm = LLM(str(path), dtype=dtype, linear_kernel=kernel, kv_cache_memory="256MiB")
    grew = rss_bytes() - before
    runner = llm.engine.executor.runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = runner.kv_cache.data.numel() * runner.kv_cache.data.element_size()
    mib = 2**20
    print(
        f"{dtype} {kernel}: RSS grew {grew / mib:.0f} MiB over the load; weights {weights / mib:.0f} MiB "
        f"+ KV {kv / mib:.0f} MiB = {(weights + kv) / mib:.0f} MiB; ratio {grew / (weights + kv):.3f} "
        f"(python + torch before the load: {before / mib:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
