"""Resident memory after loading against what the engine must hold: weights + KV cache.

Loads the throughput benchmark's model in a fresh process and prints how much the RSS grew
over the load, next to the weights' bytes (every tensor of the checkpoint at the run's dtype,
packed layouts counted at their dense size) and the KV cache's (``LLM.kv_stats()``)::

    .venv/bin/python tools/resident_memory.py float32 auto   # dtype, linear kernel
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from safetensors import safe_open

import pagedkv.engine  # noqa: F401  (imported before the baseline is read)
from pagedkv import LLM
from pagedkv.bench.bench_model import bench_model_path


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def weight_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Every tensor of the folder's safetensors files, at ``dtype``."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as tensors:
            total += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
    return total * torch.empty(0, dtype=dtype).element_size()


def main() -> None:
    dtype, kernel = (sys.argv[1:] + ["float32", "auto"][len(sys.argv) - 1 :])[:2]
    path = bench_model_path(Path("pagedkv-report") / "models")
    before = rss_bytes()
    llm = LLM(str(path), dtype=dtype, linear_kernel=kernel, kv_cache_memory="256MiB")
    grew = rss_bytes() - before
    weights = weight_bytes(path, getattr(torch, dtype))
    kv = llm.kv_stats()["kv_cache_bytes"]
    mib = 2**20
    print(
        f"{dtype} {kernel}: RSS grew {grew / mib:.0f} MiB over the load; weights {weights / mib:.0f} MiB "
        f"+ KV {kv / mib:.0f} MiB = {(weights + kv) / mib:.0f} MiB; ratio {grew / (weights + kv):.3f} "
        f"(python + torch before the load: {before / mib:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
