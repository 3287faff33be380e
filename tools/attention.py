"""Decode attention: paged backends vs contiguous SDPA, on the same data, in one run.

For each batch size and context length it builds one block pool with shuffled physical blocks
(a block table is never a range), copies the same keys/values into contiguous
``[batch, kv_heads, context, head_dim]`` tensors, and times one decode step (one query token
per sequence) with:

* ``sdpa``: ``scaled_dot_product_attention(..., enable_gqa=True)`` on the contiguous tensors;
* ``sdpa-fold``: the same, with each KV head's query heads folded into query rows (a GQA trick
  that is often faster on CPU);
* ``gather+sdpa`` (with ``--gather``): the naive paged baseline, copying every sequence's blocks
  into contiguous tensors and then calling SDPA (what the native CPU kernel avoids);
* ``paged:<backend>``: :func:`pagedkv.attention.paged_decode_attention` (no per-call checks);
* ``paged:<backend>:<fp8|int8>`` (with ``--kv-cache-dtypes``): the same on a quantized copy of
  the same pool (one byte per element plus a float32 scale per token and KV head), which reads
  2-4x fewer bytes per step; its output must stay within ``QUANT_TOLERANCE`` of SDPA's.

Ratios are paged time over the *faster* SDPA variant. Times are medians over interleaved
repeats (each repeat runs every method once), so a noisy machine slows all methods alike; a
method whose first call took over a quarter second (the ``torch`` reference on big batches)
is sampled only as often as fits in about a second.

``--prefill`` instead times one sequence's chunk of new tokens after a cached prefix (CPU):
the native row kernel vs gather + SDPA, the two paths of the ``cpu`` backend, to place the
switch between them (``NATIVE_MAX_QUERY_LEN`` in ``pagedkv/attention/backends/cpu.py``).

    python tools/attention.py            # batches 1/8/32/64, contexts 128..4096, fp32, CPU
    python tools/attention.py --quick    # fewer shapes and repeats
    python tools/attention.py --device cuda --dtype float16
    python tools/attention.py --prefill
    python tools/attention.py --batches 32 --contexts 1024 4096 --backends cpu \
        --kv-cache-dtypes auto fp8 int8        # quantized vs unquantized blocks, same run
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pagedkv.attention import AttentionOptions, KVCache, LayerKV, paged_decode_attention, write_kv
from pagedkv.attention.backends import BACKENDS, cpu
from pagedkv.memory.kv_bytes import KV_CACHE_DTYPE_NAMES, KVSpec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: how far a quantized pool's output may stray from SDPA on the unquantized keys and values: a
#: sanity bound (fp8 moves random-data outputs by up to ~0.05; a kernel that misreads the pool
#: is off by O(1)); exactness against the reference is the tests' job
QUANT_TOLERANCE = 0.1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batches 1/32, contexts 128/1024/4096, 3 repeats")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backends", nargs="+", default=None, help="default: cpu and torch on CPU, triton on CUDA"
    )
    p.add_argument("--prefill", action="store_true", help="time the cpu backend's two prefill paths instead")
    p.add_argument("--gather", action="store_true", help="also time the naive gather + SDPA paged baseline")
    p.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        choices=KV_CACHE_DTYPE_NAMES,
        default=["auto"],
        help="pool element types to time the paged backends on (default: auto, the --dtype itself)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.repeats = [1, 32], [128, 1024, 4096], 3
    if args.backends is None:
        args.backends = ["triton"] if args.device.startswith("cuda") else ["cpu", "torch"]
    return args


def timed(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def paged_methods(args: argparse.Namespace) -> list[str]:
    """``paged:<backend>`` per backend and pool type (``:<kv dtype>`` for quantized ones), for
    the pool types each backend reads."""
    names = []
    for kv_dtype in args.kv_cache_dtypes:
        suffix = "" if kv_dtype == "auto" else f":{kv_dtype}"
        names += [f"paged:{b}{suffix}" for b in args.backends if kv_dtype in BACKENDS[b].kv_cache_dtypes]
    return names


def quantized_copy(layer: LayerKV, spec: KVSpec, kv_cache_dtype: str, dtype: torch.dtype) -> LayerKV:
    """The same keys and values, block for block, in a quantized pool (written by ``write_kv``)."""
    quantized = KVCache(spec, layer.num_blocks, layer.block_size, dtype, layer.key.device, kv_cache_dtype)
    target = quantized.layers[0]
    flat = (layer.num_slots, layer.num_kv_heads, layer.head_dim)
    step = 1 << 16  # slots per write: bounds the float32 temporaries of the quantizer
    for start in range(0, layer.num_slots, step):
        slots = torch.arange(start, min(start + step, layer.num_slots), device=layer.key.device)
        write_kv(layer.key.view(flat)[slots], layer.value.view(flat)[slots], target, slots)
    return target


def run_shape(args: argparse.Namespace, batch: int, context: int) -> dict[str, float]:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(batch * 100_003 + context)
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq + 1
    spec = KVSpec(num_layers=1, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    layer = KVCache(spec, num_blocks, args.block_size, dtype, device).layers[0]
    layer.key.copy_(torch.randn(layer.key.shape, generator=gen).to(dtype))
    layer.value.copy_(torch.randn(layer.value.shape, generator=gen).to(dtype))
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    tables = tables.to(device=device, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)

    def contiguous(pool: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, context, head_dim]
        flat = pool[tables.long()].reshape(
            batch, blocks_per_seq * args.block_size, args.kv_heads, args.head_dim
        )
        return flat[:, :context].permute(0, 2, 1, 3).contiguous()

    keys, values = contiguous(layer.key), contiguous(layer.value)
    q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(device=device, dtype=dtype)
    scale = args.head_dim**-0.5
    group = args.heads // args.kv_heads
    methods: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            q[:, :, None], keys, values, scale=scale, enable_gqa=True
        ).squeeze(2),
        "sdpa-fold": lambda: F.scaled_dot_product_attention(
            q.view(batch, args.kv_heads, group, args.head_dim), keys, values, scale=scale
        ).reshape(batch, args.heads, args.head_dim),
    }
    if args.gather:
        methods["gather+sdpa"] = lambda: F.scaled_dot_product_attention(
            q.view(batch, args.kv_heads, group, args.head_dim),
            contiguous(layer.key),
            contiguous(layer.value),
            scale=scale,
        ).reshape(batch, args.heads, args.head_dim)
    layers = {"auto": layer}
    for kv_dtype in args.kv_cache_dtypes:
        if kv_dtype != "auto":
            layers[kv_dtype] = quantized_copy(layer, spec, kv_dtype, dtype)
    for name in paged_methods(args):
        backend, kv_dtype = (name.split(":") + ["auto"])[1:3]
        methods[name] = lambda b=backend, kv=layers[kv_dtype]: paged_decode_attention(
            q, kv, tables, lens, scale, backend=b
        )
    expected = methods["sdpa"]()
    wanted: dict[str, int] = {}
    for name, fn in methods.items():  # warm-up, and proof that every method computes the same
        start = time.perf_counter()
        err = (fn().float() - expected.float()).abs().max().item()
        first = time.perf_counter() - start
        wanted[name] = args.repeats if first < 0.25 else max(1, min(args.repeats, int(1.0 / first)))
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        if name.count(":") == 2:
            tolerance = QUANT_TOLERANCE
        if err > tolerance:
            raise AssertionError(f"{name} differs from sdpa by {err:.2e} at batch {batch}, context {context}")
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(args.repeats):
        for name, fn in methods.items():
            if round_ < wanted[name]:
                samples[name].append(timed(fn, device))
    return {name: statistics.median(ts) * 1e3 for name, ts in samples.items()}


def run_prefill(args: argparse.Namespace, context: int = 1024) -> None:
    """New-token chunks of growing length after a cached prefix: native rows vs gather + SDPA."""
    gen = torch.Generator().manual_seed(0)
    spec = KVSpec(num_layers=1, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    blocks = -(-context // args.block_size)
    layer = KVCache(spec, blocks, args.block_size, DTYPES[args.dtype]).layers[0]
    layer.key.copy_(torch.randn(layer.key.shape, generator=gen))
    layer.value.copy_(torch.randn(layer.value.shape, generator=gen))
    table = torch.randperm(blocks, generator=gen).to(torch.int32)[None]
    scale = args.head_dim**-0.5
    print(f"prefill chunk after a cached prefix, context {context}, cpu backend paths (ms)")
    print(f"{'new tokens':>10} {'native':>9} {'gather+sdpa':>11}")
    for n in (1, 4, 16, 64, 128, 256, 512, 1024):
        q = torch.randn(n, args.heads, args.head_dim, generator=gen).to(DTYPES[args.dtype])
        row_seq = torch.zeros(n, dtype=torch.int32)
        row_pos = torch.arange(context - n, context, dtype=torch.int32)
        methods = {
            "native": lambda q=q, s=row_seq, p=row_pos: cpu.attend_rows(
                q, layer, table, s, p, AttentionOptions(scale)
            ),
            "sdpa": lambda q=q: cpu.sdpa_sequence(q, layer, table[0], context, scale, None),
        }
        samples: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.repeats):
            for name, fn in methods.items():
                samples[name].append(timed(fn, torch.device("cpu")))
        native, sdpa = (statistics.median(samples[k]) * 1e3 for k in ("native", "sdpa"))
        print(f"{n:>10} {native:>9.3f} {sdpa:>11.3f}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.prefill:
        run_prefill(args)
        return
    print(
        f"decode attention, {args.device}, {args.dtype}: {args.heads} query heads, {args.kv_heads} KV heads, "
        f"head dim {args.head_dim}, block size {args.block_size}, torch threads {torch.get_num_threads()}, "
        f"median of {args.repeats} interleaved repeats (ms)"
    )
    paged = paged_methods(args)
    if args.gather:
        paged = ["gather+sdpa", *paged]
    header = f"{'batch':>5} {'context':>7} {'sdpa':>9} {'sdpa-fold':>9}"
    header += "".join(f" {name:>13} {'ratio':>6}" for name in paged)
    print(header)
    goal = None
    for batch in args.batches:
        for context in args.contexts:
            times = run_shape(args, batch, context)
            best = min(times["sdpa"], times["sdpa-fold"])
            line = f"{batch:>5} {context:>7} {times['sdpa']:>9.3f} {times['sdpa-fold']:>9.3f}"
            line += "".join(f" {times[name]:>13.3f} {times[name] / best:>5.2f}x" for name in paged)
            print(line, flush=True)
            if (batch, context) == (32, 1024):
                goal = {name: times[name] / best for name in paged}
            for name in paged:
                if name.count(":") == 2:
                    unquantized = name.rsplit(":", 1)[0]
                    if unquantized in times:
                        speedup = times[unquantized] / times[name]
                        print(f"      {name} vs {unquantized}: {speedup:.2f}x faster", flush=True)
    if goal:
        reached = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in goal.items())
        print(
            f"goal: paged within 1.25x of the faster contiguous SDPA at batch 32, context 1024 -> {reached}"
        )


if __name__ == "__main__":
    main()
