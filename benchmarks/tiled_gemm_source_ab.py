"""A/B of tiled GEMM kernel sources over one decoder step's weights, cold, as a decode step meets them.

``tiled_gemm_ab.py`` sets the tiled kernel against oneDNN; this one sets versions of
``pagedkv/models/csrc/tiled_gemm_cpu.c`` against each other. Each build runs every layer's
projections (q/k/v, o, gate/up, down) of issue 12's bench model and then its LM head, for each
row count, builds taking turns round by round; each keeps its best of three steps per round and
its best round. A step's weights (134 MB in float32) do not fit in the cache, so every step
reads them from DRAM, as the engine's decode steps do::

    git show HEAD~1:pagedkv/models/csrc/tiled_gemm_cpu.c > /tmp/old.c
    .venv/bin/python benchmarks/tiled_gemm_source_ab.py --source /tmp/old.c \\
        --source pagedkv/models/csrc/tiled_gemm_cpu.c --rows 1 4 8 16 32
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from pagedkv.models import tiled_gemm

SHAPES = ((512, 1024), (512, 512), (512, 2752), (1376, 512))  # (in, out): q/k/v, o, gate/up, down
LAYERS, VOCAB, HIDDEN = 6, 32000, 512


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", action="append", required=True, help="a kernel source (repeat)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24, 32])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, best kept (default: 5)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    libraries = {}
    for source in args.source:  # each build configured as the module configures its own
        tiled_gemm.SOURCE = Path(source)
        libraries[source] = tiled_gemm._library.__wrapped__()
        if isinstance(libraries[source], str):
            raise SystemExit(libraries[source])
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)

    def tiles(out_features: int, in_features: int) -> torch.Tensor:
        weight = torch.randn(out_features, in_features, generator=generator) * 0.02
        return tiled_gemm.to_tiles(weight.to(dtype))

    tiled_gemm._library = lambda: libraries[args.source[0]]  # to_tiles asks for the tile width
    layers = [[tiles(n, k) for k, n in SHAPES] for _ in range(LAYERS)]
    head = tiles(VOCAB, HIDDEN)

    def step(rows: int) -> float:
        inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in {k for k, _ in SHAPES}}
        start = time.perf_counter()
        for weights in layers:
            for (k, _), weight in zip(SHAPES, weights, strict=True):
                tiled_gemm.tiled_linear(inputs[k], weight, None)
        tiled_gemm.tiled_linear(inputs[HIDDEN], head, None)
        return time.perf_counter() - start

    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for source, library in libraries.items():
            tiled_gemm._library = lambda library=library: library
            for rows in args.rows:
                step(rows)
                best[source, rows] = min(best.get((source, rows), math.inf), *(step(rows) for _ in range(3)))
    rounds = args.rounds
    print(f"one decode step's weights, {args.dtype}, {args.threads} threads, best of {rounds} rounds (ms)")
    for rows in args.rows:
        cells = "  ".join(f"{Path(s).name}: {best[s, rows] * 1e3:6.2f}" for s in args.source)
        print(f"{rows:4d} rows  {cells}")


if __name__ == "__main__":
    main()
