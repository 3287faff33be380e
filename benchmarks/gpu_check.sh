#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script that finishes in a few minutes. The CPU suite runs
# the same code (the Triton kernels in Triton's interpreter, the padded decode steps without
# recording graphs); this runs it on the GPU. Sections, most important first:
#   1. preflight: torch sees the GPU, triton, transformers and pagedkv import (else nothing runs);
#   2. CUDA graphs: captured for every batch size, the same tokens as enforce_eager through forks,
#      beams and preemption, and no host-device sync inside a step (torch's sync debug mode);
#   3. the Triton split-KV decode and its merge kernel, compiled (the engine tests' contexts are
#      too short to split); then the Triton GGUF products (every block type, dequantization bit
#      for bit gguf-py's) and the LoRA BGMV pair compiled, and a quantized model on CUDA keeping
#      its blocks with the CPU's greedy tokens;
#   4. exactness on CUDA: float32 greedy tokens equal transformers'; bfloat16 within the documented
#      agreement criterion (tests/engine/test_bf16_agreement.py);
#   5. bench throughput on Llama-3.2-1B's shape (seeded random weights drawn on the GPU): mixed,
#      uniform and single workloads, decode steps at batch 1 and 64 against the bandwidth floor,
#      pagedkv with and without CUDA graphs, transformers on the same GPU, vLLM (its column says
#      "not run" and why when this Python cannot import it);
#   6. the same decode figures on Llama-3.1-8B's shape;
#   7. tests/attention with every paged case on the GPU (backends torch and triton);
#   8. the Triton decode kernel alone: against contiguous SDPA, on quantized blocks, and where a
#      call's time goes (GPU time per kernel, the split merge among them, vs wall and host time);
#   9. the Triton GGUF product on Llama-3.2-1B's projections (Q4_K, Q8_0; 1 and 64 rows) against
#      dequantize + F.linear and F.linear on a dense bfloat16 weight.
# Every section runs under its own time limit and the script's budget ($GPU_CHECK_BUDGET_S, default
# 480 s, which sections 1-6 fit in; 900 runs all): a section that would start past it is skipped
# and says so; a failing section is reported and the next one runs. The exit status is 1 when any
# section failed or was skipped. The script ends within about 20 s of the budget (the preflight has
# 90 s, a section past its limit gets SIGINT, then SIGKILL 15 s later). Last come the summary (each
# section's outcome) and the figures.
# Output: everything on stdout; with $OUT set, also $OUT/gpu_check.log, $OUT/summary.txt and each
# bench's JSON ($OUT/bench-<shape>.json).
# Usage: benchmarks/gpu_check.sh   (from anywhere; uses .venv/bin/python if present, else python3;
#        wheels under .whl/, if any, are installed into /tmp/site first: see docs/gpu.md)
#        GPU_CHECK_DRY_RUN=1 benchmarks/gpu_check.sh   runs the script's own logic on the CPU: the
#        tests are only collected, the benches run a tiny model's shape, the kernel section is left out.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DRY_RUN=${GPU_CHECK_DRY_RUN:-}
DEVICE=cuda
[ -n "$DRY_RUN" ] && DEVICE=cpu
export PY DEVICE PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PAGEDKV_TEST_DEVICE=$DEVICE
BUDGET=${GPU_CHECK_BUDGET_S:-480}
export RESULTS=${OUT:-$(mktemp -d)}
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.txt"
: >"$SUMMARY"
STARTED=$SECONDS
STATUS=0

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

# section NAME LIMIT_S COMMAND...: run COMMAND (a program or an exported function of this script)
# under the smaller of LIMIT_S and the budget left; its failure is reported, never fatal.
section() {
    local name=$1 limit=$2 why
    shift 2
    local left=$((BUDGET - (SECONDS - STARTED)))
    if [ "$left" -lt 30 ]; then
        echo "== $name: SKIPPED (the script's ${BUDGET} s budget is spent)"
        echo "SKIPPED  $name: the ${BUDGET} s budget was spent" >>"$SUMMARY"
        STATUS=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo
    echo "== $name (at most ${limit} s) =="
    local start=$SECONDS rc=0
    timeout --signal=INT --kill-after=15 "$limit" bash -c '"$@"' section "$@" || rc=$?
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        echo "-- $name: ok (${took} s)"
        echo "ok       $name (${took} s)" >>"$SUMMARY"
    else
        if [ "$rc" -eq 124 ]; then why="timed out after ${limit} s"; else why="exit status $rc"; fi
        echo "-- $name: FAILED ($why, ${took} s)"
        echo "FAILED   $name ($why, ${took} s)" >>"$SUMMARY"
        STATUS=1
    fi
}

preflight() {
    "$PY" - <<'PY'
import importlib, os, sys
import torch
if os.environ["DEVICE"] == "cuda":
    assert torch.cuda.is_available(), "no CUDA GPU visible: this script is for a GPU machine"
    print(f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
print(f"torch {torch.__version__}, python {sys.version.split()[0]}")
for name in ("triton", "transformers", "pagedkv.llm", "pagedkv.bench.throughput_engines", "vllm"):
    try:
        module = importlib.import_module(name)
        print(f"  {name}: {getattr(module, '__version__', 'imports')}")
    except ImportError as err:
        if name == "vllm":
            print(f"  vllm: not installed in this image ({err}): its column says 'not run'")
        else:
            sys.exit(f"  {name} does not import: {err} (carry its wheels under .whl/, see docs/gpu.md)")
PY
}

# bench SHAPE ENGINES WORKLOADS REPEATS: what `pagedkv bench throughput --device cuda --model-shape
# SHAPE --dtypes bfloat16 --engines ENGINES --workloads WORKLOADS --decode-batches 1 64 --repeats
# REPEATS` runs, through the bench's Python API (the same code; the command line would import the
# server's dependencies too); its JSON goes to $RESULTS/bench-SHAPE.json. A dry run takes a tiny
# model of config.json alone and smaller shapes.
bench() {
    "$PY" - "$@" <<'PY'
import json, os, sys, tempfile
from pathlib import Path
from rich.console import Console
from pagedkv.bench.throughput import ThroughputConfig
from pagedkv.bench.throughput_engines import run_throughput
from pagedkv.bench.throughput_report import print_result

shape, engines, workloads, repeats = sys.argv[1:]
work = Path(tempfile.mkdtemp(prefix="pagedkv-bench-"))
model = {"model_shape": shape}
sizes = {}
if os.environ["DEVICE"] == "cpu":  # the dry run
    from tests.checkpoints import hf_config

    (work / "config.json").write_text(json.dumps(hf_config("llama").to_dict()))
    model = {"model": str(work), "load_format": "dummy"}
    sizes = {"num_requests": 4, "prompt_len": 8, "max_tokens": 6}
config = ThroughputConfig(
    device=os.environ["DEVICE"], dtypes=("bfloat16",), engines=tuple(engines.split()),
    workloads=tuple(workloads.split()), decode_batches=(1, 64), repeats=int(repeats),
    vllm_python=sys.executable, threads=8, out=work / "out", **model, **sizes,
)
result = run_throughput(config)
print_result(result, Console(width=160))
Path(os.environ["RESULTS"], f"bench-{shape}.json").write_text(json.dumps(result.to_json(), indent=1, default=str))
sys.exit(0 if result.ok else 1)
PY
}

kernel_benchmarks() {
    echo "-- decode benchmark: paged triton vs contiguous SDPA, float16 --"
    "$PY" tools/attention.py --device cuda --dtype float16 --quick --backends triton torch || return
    echo "-- triton on fp8 / int8 blocks vs float16 blocks, same run --"
    "$PY" tools/attention.py --device cuda --dtype float16 --batches 32 --contexts 1024 4096 \
        --repeats 10 --backends triton --kv-cache-dtypes auto fp8 int8 || return
    echo "-- a triton decode call: GPU time per kernel against wall and host time, float16 --"
    "$PY" - <<'PY'
import statistics, time
import torch
from torch.profiler import ProfilerActivity, profile
from pagedkv.attention import KVCache, paged_decode_attention
from pagedkv.memory.kv_bytes import KVSpec

dev, heads, kv_heads, dim, bs = torch.device("cuda"), 32, 8, 128, 16
for batch, ctx in [(1, 128), (1, 4096), (32, 1024), (32, 4096), (64, 4096), (256, 1024)]:
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
}

# the Triton GGUF product against dequantizing per call (what a quantized layer on CUDA did
# before it) and against a dense bfloat16 weight, on Llama-3.2-1B's projections, CUDA events
quant_benchmarks() {
    "$PY" - <<'PY'
import torch
import torch.nn.functional as F
from pagedkv.kernels import triton_quant
from pagedkv.kernels.quant_gemm import BLOCKS
from tests.quant_blocks import Q, random_blocks

dev = torch.device("cuda")
shapes = {"qkv_proj": (3072, 2048), "o_proj": (2048, 2048), "gate_up_proj": (16384, 2048), "down_proj": (2048, 8192)}


def micros(call, repeats=50):
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


print("us per call (GB/s of the weight's bytes read), bfloat16 activations, CUDA events over 50 calls")
for qtype in (Q.Q4_K, Q.Q8_0):
    for name, (n, k) in shapes.items():
        blocks = torch.from_numpy(random_blocks(qtype, n, k, seed=n + k)).to(dev)
        dense = triton_quant.dequantize(blocks, int(qtype), k, torch.bfloat16)
        for rows in (1, 64):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            fused = micros(lambda: triton_quant.quant_linear(x, blocks, int(qtype), None, out))
            per_call = micros(lambda: F.linear(x, triton_quant.dequantize(blocks, int(qtype), k, torch.bfloat16)))
            floor = micros(lambda: F.linear(x, dense))
            gbs = blocks.numel() / fused / 1e3
            torch.testing.assert_close(out.float(), F.linear(x, dense).float(), rtol=0.02, atol=0.02 * k**0.5)
            print(f"{qtype.name} {name:>12} [{n}, {k}] rows {rows:2d}: triton {fused:7.1f} us ({gbs:5.0f} GB/s), "
                  f"dequantize + F.linear {per_call:7.1f} us, dense bf16 F.linear {floor:7.1f} us")
PY
}

# the figures of every bench JSON, one line each
figures() {
    "$PY" - <<'PY'
import json, os
from pathlib import Path

titles = {"pagedkv": "pagedkv", "pagedkv-eager": "pagedkv enforce_eager", "transformers": "transformers", "vllm": "vLLM"}
for path in sorted(Path(os.environ["RESULTS"]).glob("bench-*.json")):
    data = json.loads(path.read_text())
    print(f"{path.stem.removeprefix('bench-')}, bfloat16, device copy rate {data['copy_rate_gbs']:,.0f} GB/s:")
    for f in data["decode"]:
        step = "no figure (noise)" if f["step_ms"] is None else (
            f"{f['step_ms']:8.3f} ms/step {f['tokens_per_s']:9,.0f} tok/s {100 * f['floor_share']:4.0f}% of the floor")
        print(f"  decode batch {f['batch']:>2} {titles[f['engine']]:<22} {step} (floor {f['floor_ms']:.3f} ms)")
    for row in data["throughput"]:
        rates, over = row["tokens_per_s"], row["pagedkv_over"].get("transformers")
        if rates.get("pagedkv"):
            ratio = f" = {over:.2f}x transformers" if over else ""
            print(f"  {row['workload']:<9} pagedkv {rates['pagedkv']:9,.0f} generated tok/s{ratio}")
    for engine, status in data["engines"].get("bfloat16", {}).items():
        if status["state"] != "ok":
            print(f"  {titles.get(engine, engine)}: {status['state']}: {status['reason'][:160]}")
PY
}

export -f preflight bench kernel_benchmarks quant_benchmarks

main() {
    echo "== preflight (at most 90 s) =="
    if ! timeout --kill-after=10 90 bash -c preflight; then
        echo "FAILED   preflight: nothing else can run" >>"$SUMMARY"
        cat "$SUMMARY"
        return 1
    fi
    local collect=()
    [ -n "$DRY_RUN" ] && collect=(--collect-only)
    # --confcutdir: these tests need none of tests/conftest.py's browser fixtures (selenium)
    local pytest=("$PY" -m pytest -q -p no:cacheprovider -rs --durations=5 -m "cuda or not cuda" "${collect[@]}")
    section "CUDA graphs: captured, same tokens as enforce_eager, no sync inside a step" 150 \
        "${pytest[@]}" --confcutdir=tests/engine tests/engine/worker/test_cuda_graphs.py
    section "Triton split-KV decode and its merge kernel, compiled" 90 \
        "${pytest[@]}" --confcutdir=tests/attention tests/attention/test_attention_triton.py
    section "Triton GGUF products and LoRA BGMV on CUDA; quantized models keep their blocks" 180 \
        "${pytest[@]}" --confcutdir=tests/kernels tests/kernels/test_triton_quant.py \
        tests/lora/test_triton_lora.py tests/models/test_quantized_cuda.py
    section "exactness on CUDA: float32 greedy = transformers, bfloat16 agreement" 240 \
        "${pytest[@]}" --confcutdir=tests/engine tests/engine/test_engine_exactness.py \
        tests/engine/test_bf16_agreement.py
    section "bench throughput, Llama-3.2-1B shape, bfloat16" 270 \
        bench llama-3.2-1b "pagedkv pagedkv-eager transformers vllm" "mixed uniform single" 2
    section "bench throughput, Llama-3.1-8B shape, bfloat16 (decode steps)" 150 \
        bench llama-3.1-8b "pagedkv pagedkv-eager transformers" "single" 1
    section "tests/attention on the GPU (torch + triton backends)" 150 \
        "${pytest[@]}" --confcutdir=tests/attention tests/attention
    if [ -z "$DRY_RUN" ]; then
        section "the Triton decode kernel alone: vs SDPA, quantized blocks, time per kernel" 150 kernel_benchmarks
        section "the Triton GGUF product on Llama-3.2-1B's projections vs dequantize + F.linear" 90 \
            quant_benchmarks
    fi
    echo >>"$SUMMARY"
    figures >>"$SUMMARY" || STATUS=1
    echo
    echo "== summary: every section, then the figures ($((SECONDS - STARTED)) s in all) =="
    cat "$SUMMARY"
    return $STATUS
}

main 2>&1 | tee "$RESULTS/gpu_check.log"
exit "${PIPESTATUS[0]}"
