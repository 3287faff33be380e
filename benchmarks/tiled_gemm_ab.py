"""A/B of the linear kernels over one decoder step's weights, as a step meets them: cold.

Timing one GEMM over and over keeps its weight in cache; in a step every weight comes from DRAM.
This runs each layer's projections (q/k/v, o, gate/up, down) for every layer and then the LM
head (decode sizes only), oneDNN packed against pagedkv's tiled kernel, alternating rounds, and
prints the best round of each at each row count. Where oneDNN has no native bfloat16 (an AVX2-only
CPU) the bfloat16 baseline is ``F.linear``, which torch then runs in its own emulated kernel.
Shapes default to issue 12's bench model::

    .venv/bin/python benchmarks/tiled_gemm_ab.py --dtype float32 --rows 1 8 32 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedkv.models.tiled_gemm import runs_dtype, tiled_linear, to_tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 512, 2048])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--qkv", type=int, default=1024, help="q + k + v output columns")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if (why := runs_dtype(dtype)) is not None:
        raise SystemExit(f"the tiled kernel cannot run {args.dtype} here: {why}")
    h = args.hidden
    shapes = [(h, args.qkv), (h, h), (h, 2 * args.intermediate), (args.intermediate, h)]
    gen = torch.Generator().manual_seed(0)
    layers = [
        [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for k, n in shapes] for _ in range(args.layers)
    ]
    head = (torch.randn(args.vocab, h, generator=gen) * 0.02).to(dtype)
    native = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if native:
        baseline_name = "oneDNN"
        baseline = [[torch.ops.mkldnn._reorder_linear_weight(w, 2048) for w in ws] for ws in layers]
        baseline_head = torch.ops.mkldnn._reorder_linear_weight(head, 2048)

        def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    else:
        baseline_name, baseline, baseline_head = "F.linear", layers, head

        def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, w)

    tiled = [[to_tiles(w) for w in ws] for ws in layers]
    tiled_head = to_tiles(head)
    print(f"{args.dtype}, {args.threads} threads: best of {args.rounds} alternating rounds")
    title, ratio = f"{baseline_name} ms", f"tiled/{baseline_name}"
    print(f"{'rows':>6} {title:>11} {'GFLOP/s':>8} {'tiled ms':>9} {'GFLOP/s':>8} {ratio:>15}")
    for rows in args.rows:
        with_head = rows <= 64  # the head sees one row per sequence, never a prefill chunk
        flops = 2 * rows * (args.layers * sum(k * n for k, n in shapes) + (head.numel() if with_head else 0))
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k, _ in shapes}

        def run_baseline(inputs=inputs, with_head=with_head) -> None:
            for ws in baseline:
                for (k, _), w in zip(shapes, ws, strict=True):
                    linear(inputs[k], w)
            if with_head:
                linear(inputs[h], baseline_head)

        def run_tiled(inputs=inputs, with_head=with_head) -> None:
            for ws in tiled:
                for (k, _), w in zip(shapes, ws, strict=True):
                    tiled_linear(inputs[k], w, None)
            if with_head:
                tiled_linear(inputs[h], tiled_head, None)

        best = {"baseline": float("inf"), "tiled": float("inf")}
        for _ in range(args.rounds):
            for name, run in (("baseline", run_baseline), ("tiled", run_tiled)):
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
        a, b = best["baseline"], best["tiled"]
        rates = f"{a * 1e3:>11.2f} {flops / a / 1e9:>8.0f} {b * 1e3:>9.2f} {flops / b / 1e9:>8.0f}"
        print(f"{rows:>6} {rates} {a / b:>14.2f}x")


if __name__ == "__main__":
    main()
