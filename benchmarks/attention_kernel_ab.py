"""A/B of CPU paged-attention kernel sources: decode attention of each build on the same cache.

Builds every ``--source`` (a version of ``pagedkv/attention/backends/csrc/paged_attention_cpu.c``,
e.g. one taken with ``git show REV:path > old.c``) through :mod:`pagedkv.cbuild`, then times a
decode step's attention for each case, the builds taking turns round by round (background load
hits them alike), best of ``--rounds``. Blocks are handed out in a random order, as a long-running
pool does. Prints microseconds, the KV bytes read per second, and each build's largest difference
from the first one's output.

    git show cf75844:pagedkv/attention/backends/csrc/paged_attention_cpu.c > /tmp/old.c
    .venv/bin/python benchmarks/attention_kernel_ab.py --source /tmp/old.c \\
        --source pagedkv/attention/backends/csrc/paged_attention_cpu.c --threads 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pagedkv import cbuild
from pagedkv.attention import AttentionOptions, KVCache
from pagedkv.attention.backends import cpu, native
from pagedkv.memory.spec import KVSpec

DEFAULT_CASES = ("float32:32:200", "bfloat16:32:200", "float32:1:2000", "float32:64:500", "bfloat16:64:500")


def load_kernels(sources: list[str]) -> dict[str, native.NativeKernel]:
    kernels = {}
    for source in sources:
        built = cbuild.build(Path(source))
        if isinstance(built, str):
            raise SystemExit(built)
        kernels[source] = native.NativeKernel(built)
    return kernels


def time_case(
    kernels: dict[str, native.NativeKernel], case: str, rounds: int, heads: tuple[int, int, int]
) -> str:
    dtype_name, batch, context = case.split(":")
    dtype, batch, context = getattr(torch, dtype_name), int(batch), int(context)
    num_heads, kv_heads, head_dim = heads
    block_size = 16
    per_seq = -(-context // block_size)
    cache = KVCache(KVSpec(1, kv_heads, head_dim, "float32"), batch * per_seq + 1, block_size, dtype)
    layer = cache.layers[0]
    generator = torch.Generator().manual_seed(0)
    layer.key.copy_(torch.randn(layer.key.shape, generator=generator).to(dtype))
    layer.value.copy_(torch.randn(layer.value.shape, generator=generator).to(dtype))
    tables = (torch.randperm(batch * per_seq, generator=generator) + 1).view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch, num_heads, head_dim, generator=generator).to(dtype)
    rows = cpu.KernelRows.of(tables, torch.arange(batch), torch.full((batch,), context - 1))
    options = AttentionOptions(head_dim**-0.5)
    calls = max(3, 200_000 // (batch * context))
    best = dict.fromkeys(kernels, float("inf"))
    outputs = {}
    for _ in range(rounds):
        for source, kernel in kernels.items():
            native.load = lambda kernel=kernel: kernel  # what cpu._attend asks for
            outputs[source] = cpu._attend(q, layer, rows, options)
            start = time.perf_counter()
            for _ in range(calls):
                cpu._attend(q, layer, rows, options)
            best[source] = min(best[source], (time.perf_counter() - start) / calls)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * layer.key.element_size()
    first = outputs[next(iter(kernels))].float()
    cells = [
        f"{Path(source).name}: {best[source] * 1e6:8.1f} us {kv_bytes / best[source] / 1e9:5.1f} GB/s "
        f"diff {float((outputs[source].float() - first).abs().max()):.1e}"
        for source in kernels
    ]
    return f"{case:>16}  " + "  |  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", action="append", required=True, help="a kernel source (repeat)")
    parser.add_argument(
        "--case",
        action="append",
        default=None,
        help=f"dtype:rows:context (default: {' '.join(DEFAULT_CASES)})",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads (default: 1)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds, best kept (default: 9)")
    parser.add_argument("--heads", default="8,4,64", help="query heads, KV heads, head dim (default: 8,4,64)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels(args.source)
    heads = tuple(int(n) for n in args.heads.split(","))
    for case in args.case or DEFAULT_CASES:
        print(time_case(kernels, case, args.rounds, heads), flush=True)


if __name__ == "__main__":
    main()
