"""What the hardware allows a workload of ``pagedkv bench throughput``, against its GEMM roofline.

The benchmark's roofline times each linear layer alone with its weight warm in cache. A step of
the benchmark's model cannot run that way: its weights (136 MB in float32) and the KV cache of
32 requests do not fit in the last-level cache, so every step streams both from DRAM. This script bounds a
workload's time from below with both limits: each step takes at least its multiply-adds at the
fastest GEMM rate the benchmark measured, and at least its weights plus the KV cache it reads at
the DRAM read bandwidth measured here (a 1 GiB ``torch.sum``, best of 8), whichever is longer --
overlap assumed perfect, attention's arithmetic, sampling and Python free. It prints that floor,
the roofline, and the share of the roofline the floor itself allows::

    .venv/bin/python tools/physical_floor.py pagedkv-report/throughput.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from pagedkv.bench.throughput import WorkloadShape, build_workload
from pagedkv.bench.throughput_gemm import linear_shapes

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}


def dram_read_bandwidth(threads: int) -> float:
    """Bytes per second ``torch.sum`` reads from a 1 GiB tensor on ``threads`` threads (best of 8)."""
    torch.set_num_threads(threads)
    data = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(8):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def floor_seconds(
    config: dict, shape: WorkloadShape, name: str, dtype: str, peak_flops: float, bandwidth: float
) -> float:
    """The workload's time if every step ran at the slower of its two limits, each at its best
    (see the module doc)."""
    workload = build_workload(name, shape, config["vocab_size"])
    shapes = linear_shapes(config)
    layer_params = config["num_hidden_layers"] * sum(k * n for s, (k, n) in shapes.items() if s != "lm_head")
    head_params = shapes["lm_head"][0] * shapes["lm_head"][1]
    size = ELEMENT_BYTES[dtype]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_bytes_per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim * size
    seconds = 2 * layer_params * workload.prompt_tokens / peak_flops + head_params * size / bandwidth
    context = [len(p) + 1 for p in workload.prompts]
    for step in range(1, max(workload.max_tokens)):
        running = [i for i, m in enumerate(workload.max_tokens) if m > step]
        flops = 2 * len(running) * (layer_params + head_params)
        kv_read = sum(context[i] + step for i in running) * kv_bytes_per_token
        read = (layer_params + head_params) * size + kv_read
        seconds += max(flops / peak_flops, read / bandwidth)
    return seconds


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        report = json.load(f)
    fields = ("num_requests", "prompt_len", "max_tokens", "seed")
    config, shape = report["model"]["config"], WorkloadShape(*(report["config"][f] for f in fields))
    bandwidth = dram_read_bandwidth(report["config"]["threads"])
    print(f"DRAM read bandwidth, {report['config']['threads']} threads: {bandwidth / 1e9:.1f} GB/s")
    runs = [r for r in report["runs"] if r["engine"] == "pagedkv"]
    achieved = {(r["dtype"], r["workload"]): r["median_s"] for r in runs}
    for roof in report["roofline"]:
        dtype, name = roof["dtype"], roof["workload"]
        if name not in ("mixed", "uniform", "single"):
            continue
        peak = max(t["gflops"] for t in report["gemm"][dtype] if t["gflops"]) * 1e9
        floor = floor_seconds(config, shape, name, dtype, peak, bandwidth)
        line = (
            f"{dtype:8s} {name:7s}: roofline {roof['seconds']:.3f} s, floor {floor:.3f} s "
            f"(peak GEMM {peak / 1e9:.0f} GFLOP/s): the floor allows "
            f"{roof['seconds'] / floor:.0%} of the roofline"
        )
        ran = achieved.get((dtype, name))
        if ran:
            line += f"; pagedkv ran {ran:.3f} s: {floor / ran:.0%} of the floor's speed"
        print(line)


if __name__ == "__main__":
    main()
