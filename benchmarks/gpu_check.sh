#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script (the CPU suite runs the same Triton kernel in
# Triton's interpreter; this compiles it for the GPU):
#   1. tests/attention with every paged case on the GPU (backends torch and triton);
#   2. the decode benchmark, paged triton vs contiguous SDPA, fp32 (quick) and fp16 (full grid);
#   3. triton on quantized (fp8, int8) blocks vs float16 blocks at batch 32.
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
PAGEDKV_TEST_DEVICE=cuda "$PY" -m pytest tests/attention -q -p no:cacheprovider -x

echo "== decode benchmark: paged triton vs contiguous SDPA, float32 =="
"$PY" benchmarks/attention.py --device cuda --dtype float32 --quick --backends triton torch

echo "== decode benchmark: paged triton vs contiguous SDPA, float16 =="
"$PY" benchmarks/attention.py --device cuda --dtype float16 --repeats 20 --backends triton

echo "== decode benchmark: triton on fp8 / int8 blocks vs float16 blocks, same run =="
"$PY" benchmarks/attention.py --device cuda --dtype float16 --batches 32 --contexts 1024 4096 \
    --repeats 20 --backends triton --kv-cache-dtypes auto fp8 int8
