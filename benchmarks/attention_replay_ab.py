"""A/B of CPU paged-attention kernel sources on a real workload's decode steps, cold as in a step.

``attention_kernel_ab.py`` times one synthetic step again and again, so its blocks stay in cache
unless the step is larger than the cache. In the engine every decode call finds its blocks in
DRAM: between two calls of a layer, the other layers' weights and KV blocks have streamed
through. This script runs the bench model's mixed workload (``pagedkv bench throughput``'s) once
through the engine to record every decode step's block tables and context lengths, then replays
those steps on a 6-layer pool with each ``--source`` in turn, streaming a layer's worth of
weights (12 MB) between calls and an LM head's (64 MB) between steps, and timing the attention
calls alone. Prints the best round of each build in ms and GB/s of keys and values read::

    git show HEAD~1:pagedkv/attention/backends/csrc/paged_attention_cpu.c > /tmp/old.c
    .venv/bin/python benchmarks/attention_replay_ab.py --source /tmp/old.c \\
        --source pagedkv/attention/backends/csrc/paged_attention_cpu.c
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams, cbuild
from pagedkv.attention import AttentionOptions, KVCache
from pagedkv.attention.backends import cpu, native
from pagedkv.bench.throughput_model import BENCH_MODEL_CONFIG, bench_model_path
from pagedkv.bench.throughput_workloads import WorkloadShape, build_workload
from pagedkv.memory.spec import KVSpec

BLOCK_SIZE = 16


def record_decode_steps(model: Path, dtype: str) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(pool blocks, [(block tables, context lengths)] of every decode step) of one mixed run."""
    workload = build_workload("mixed", WorkloadShape(), BENCH_MODEL_CONFIG["vocab_size"])
    tokens = sum(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens, strict=True))
    num_blocks = -(-tokens // BLOCK_SIZE) + 48  # as `pagedkv bench throughput` sizes its pool
    llm = LLM(
        str(model),
        dtype=dtype,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
    )
    steps: list[tuple[object, torch.Tensor, torch.Tensor]] = []
    build_rows = cpu.decode_rows

    def recording(metadata):  # every layer of a step passes the same metadata
        if not steps or steps[-1][0] is not metadata:
            steps.append((metadata, metadata.block_tables.clone(), metadata.context_lens.clone()))
        return build_rows(metadata)

    cpu.decode_rows = recording
    try:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens]
        llm.generate([list(p) for p in workload.prompts], params, use_tqdm=False)
    finally:
        cpu.decode_rows = build_rows
    return num_blocks, [(tables, lens) for _, tables, lens in steps]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", action="append", required=True, help="a kernel source (repeat)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, best kept (default: 5)")
    parser.add_argument("--every", type=int, default=3, help="replay every n-th decode step (default: 3)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    num_blocks, steps = record_decode_steps(bench_model_path(Path("pagedkv-report")), args.dtype)
    steps = steps[:: args.every]
    config = BENCH_MODEL_CONFIG
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    layers = config["num_hidden_layers"]
    cache = KVCache(KVSpec(layers, kv_heads, head_dim, "float32"), num_blocks, BLOCK_SIZE, dtype)
    generator = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.key.copy_(torch.randn(layer.key.shape, generator=generator).to(dtype))
        layer.value.copy_(torch.randn(layer.value.shape, generator=generator).to(dtype))
    kernels = {}
    for source in args.source:
        built = cbuild.build(Path(source))
        if isinstance(built, str):
            raise SystemExit(built)
        kernels[source] = native.NativeKernel(built)
    layer_weights, head_weights = torch.randn(3_000_000), torch.randn(16_000_000)  # 12 MB, 64 MB
    options = AttentionOptions(head_dim**-0.5)
    rows = [cpu.KernelRows.of(tables, torch.arange(len(lens)), lens - 1) for tables, lens in steps]
    queries = [torch.randn(len(lens), heads, head_dim, generator=generator).to(dtype) for _, lens in steps]
    kv_bytes = sum(int(lens.sum()) for _, lens in steps) * layers * kv_heads * head_dim * 2 * dtype.itemsize
    best = dict.fromkeys(kernels, math.inf)
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for source, kernel in kernels.items():
            native.load = lambda kernel=kernel: kernel  # what cpu._attend asks for
            seconds = 0.0
            for step_rows, q in zip(rows, queries, strict=True):
                head_weights.sum()
                for layer in cache.layers:
                    layer_weights.sum()
                    start = time.perf_counter()
                    outputs[source] = cpu._attend(q, layer, step_rows, options)
                    seconds += time.perf_counter() - start
            best[source] = min(best[source], seconds)
    first = outputs[args.source[0]].float()
    gigabytes = kv_bytes / 1e9
    print(f"{len(steps)} decode steps x {layers} layers, {gigabytes:.2f} GB of keys and values, {args.dtype}")
    for source in kernels:
        diff = float((outputs[source].float() - first).abs().max())
        print(
            f"{Path(source).name:>28}: {best[source] * 1e3:8.1f} ms"
            f"  {kv_bytes / best[source] / 1e9:5.1f} GB/s  diff {diff:.1e}"
        )


if __name__ == "__main__":
    main()
