#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script (the CPU suite runs the same Triton kernel in
# Triton's interpreter; this compiles it for the GPU):
#   1. tests/attention with every paged case on the GPU (backends torch and triton);
#   2. the decode benchmark, paged triton vs contiguous SDPA, fp32 (quick) and fp16 (full grid);
#   3. triton on quantized (fp8, int8) blocks vs float16 blocks at batch 32;
#   4. where a triton decode call's time goes: the GPU's time in each kernel (torch.profiler)
#      against the call's wall time and its host part (the benchmarks above time whole calls).
# Usage: benchmarks/gpu_check.sh            (from anywhere; uses .venv/bin/python if present)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

"$PY" - <<'PY'
import torch, triton
assert torch.cuda.is_available(), "no CUDA GPU visible: this script is for a GPU machine"
print(f"{torch.cuda.get_device_name(0)}  torch {torch.__version__}  triton {triton.__version__}")
PY

echo "== tests/attention on the GPU (torch + triton backends) =="
# --confcutdir: the attention tests need none of tests/conftest.py's browser fixtures, whose
# selenium a GPU image may lack. Every failure is listed (no -x) and the benchmarks still run:
# one device lease shows all of it; the script's status is pytest's.
tests_status=0
PAGEDKV_TEST_DEVICE=cuda "$PY" -m pytest tests/attention -q -p no:cacheprovider \
    --confcutdir=tests/attention --durations=5 || tests_status=$?

echo "== decode benchmark: paged triton vs contiguous SDPA, float32 =="
"$PY" tools/attention.py --device cuda --dtype float32 --quick --backends triton torch

echo "== decode benchmark: paged triton vs contiguous SDPA, float16 =="
"$PY" tools/attention.py --device cuda --dtype float16 --repeats 20 --backends triton

echo "== decode benchmark: triton on fp8 / int8 blocks vs float16 blocks, same run =="
"$PY" tools/attention.py --device cuda --dtype float16 --batches 32 --contexts 1024 4096 \
    --repeats 20 --backends triton --kv-cache-dtypes auto fp8 int8

echo "== a triton decode call: GPU time per kernel against wall and host time, float16 =="
"$PY" - <<'PY'
import statistics, time
import torch
from torch.profiler import ProfilerActivity, profile
from pagedkv.attention import KVCache, paged_decode_attention
from pagedkv.memory.spec import KVSpec

dev, heads, kv_heads, dim, bs = torch.device("cuda"), 32, 8, 128, 16
for batch, ctx in [(1, 128), (32, 1024), (32, 4096), (64, 4096), (256, 1024)]:
    per_seq = -(-ctx // bs)
    layer = KVCache(KVSpec(1, kv_heads, dim, "float16"), batch * per_seq + 1, bs, torch.float16, dev).layers[0]
    layer.key.normal_(), layer.value.normal_()
    tables = torch.randperm(batch * per_seq + 1)[: batch * per_seq].view(batch, per_seq).to(dev, torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.float16)

    def call():
        return paged_decode_attention(q, layer, tables, lens, dim**-0.5, backend="triton")

    for _ in range(5):
        call()
    wall, host = [], []
    for _ in range(30):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            call()
        torch.cuda.synchronize()
    kernels = {e.key: e.device_time_total / 20 for e in prof.key_averages() if e.device_time_total > 0}
    gpu_us = sum(kernels.values())
    kv_bytes = batch * ctx * kv_heads * dim * 2 * 2
    top = ", ".join(f"{k[:32]} {v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:3])
    print(f"batch {batch:3d} context {ctx:4d}: wall {statistics.median(wall) * 1e6:5.0f} us, host "
          f"{statistics.median(host) * 1e6:5.0f} us, GPU {gpu_us:6.1f} us ({kv_bytes / gpu_us / 1e6:.2f} TB/s "
          f"of keys and values; us per kernel: {top})")
PY

exit $tests_status
