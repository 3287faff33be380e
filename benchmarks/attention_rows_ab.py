"""The paged-attention row kernel of several built kernel libraries, timed against each other on
SmolLM2-135M's decode shape: 9 query heads over 3 KV heads, head dimension 64, blocks of 16, 32
sequences of 200 to 600 positions in shuffled blocks, one decode row each.

The libraries are called in turn in one process (ABAB..., the order reversed every other round),
so a machine that other work shares slows them alike; each figure is the median over rounds of
one call's time, averaged over the round's calls (thread CPU time with one thread, wall time with
more). ``layers`` separate pools are walked in turn, as a model's layers are: with 30 of them
(about 300 MB in bfloat16) the pools do not stay in cache between calls; with 1 they do. The last
column is the largest difference of each library's output from the first one's.

Build each source tree into its own cache and pass the libraries it leaves there:

  PYTHONPATH=TREE PAGEDKV_KERNEL_CACHE=/tmp/kc-a python -c \\
      "from pagedkv.kernels import paged_attention; paged_attention.load()"
  python benchmarks/attention_rows_ab.py bf16 1 30 40 /tmp/kc-a/pagedkv_kernels-*.so /tmp/kc-b/...so

Arguments: dtype (bf16 or f32), threads, layers, rounds, then the libraries.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK, SEQUENCES = 9, 3, 64, 16, 32
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def main(name: str, threads: int, layers: int, rounds: int, libraries: list[str]) -> None:
    dtype = DTYPES[name]
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(200, 601, (SEQUENCES,), generator=gen)
    max_blocks = int((lens.max() + BLOCK - 1) // BLOCK)
    num_blocks = SEQUENCES * max_blocks + 1
    tables = torch.randperm(num_blocks, generator=gen)[: SEQUENCES * max_blocks].to(torch.int32)
    tables = tables.view(SEQUENCES, max_blocks).contiguous()
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    keys = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    values = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    q = torch.randn(SEQUENCES, HEADS, HEAD_DIM, generator=gen).to(dtype)
    row_seq = torch.arange(SEQUENCES, dtype=torch.int32)
    row_pos = (lens - 1).to(torch.int32)
    chunk = 2048 if threads == 1 else max(64, -(-int(lens.sum()) // (4 * threads)))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    entries = []
    for path in libraries:
        entry = getattr(ctypes.CDLL(path), f"paged_attention_rows_{name}")
        entry.argtypes = [ptr] * 9 + [i64] * 6 + [ctypes.c_float, i64, ctypes.c_float, i64, ctypes.c_int]
        entry.restype = ctypes.c_int
        entries.append(entry)
    outs = [torch.empty_like(q) for _ in libraries]

    def call(i: int, layer: int) -> None:
        status = entries[i](
            q.data_ptr(), keys[layer].data_ptr(), values[layer].data_ptr(), None, None,
            tables.data_ptr(), row_seq.data_ptr(), row_pos.data_ptr(), outs[i].data_ptr(),
            SEQUENCES, HEADS, KV_HEADS, HEAD_DIM, BLOCK, max_blocks, HEAD_DIM**-0.5, 0, 0.0, chunk, threads,
        )  # fmt: skip
        assert status == 0

    clock = time.thread_time if threads == 1 else time.perf_counter
    samples: list[list[float]] = [[] for _ in libraries]
    for r in range(rounds):
        for i in range(len(libraries)) if r % 2 == 0 else reversed(range(len(libraries))):
            start = clock()
            for layer in range(layers):
                call(i, layer)
            samples[i].append((clock() - start) / layers * 1e6)
    for i, path in enumerate(libraries):
        kept = samples[i][2:]  # the first rounds warm the caches and the libraries' threads
        diff = (outs[i].float() - outs[0].float()).abs().max().item()
        median, least = statistics.median(kept), min(kept)
        print(f"{path}: median {median:.1f} us, min {least:.1f} us, max |diff| {diff:.2e}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
