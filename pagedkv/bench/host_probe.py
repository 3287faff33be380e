"""How fast the host reads memory right now, measured the same way at a benchmark's start and end.

:mod:`pagedkv.bench.machine_load` sees the processes of this machine only. On a virtual machine
the other tenants of the host share its DRAM and L3, and their traffic moves every engine's
figures without a trace in ``/proc/stat``: on the Zen 1 host of 2026-12-03 a tensor sum read
20.5 GB/s at 17:30 UTC and 14.4 GB/s at 18:12, while a loop of multiply-adds kept its 80
GFLOP/s, and pagedkv's mixed float32 run moved 323-433 tokens/s on the same code. The benchmark
prints the read rate at both ends of its run, so that a reader can tell a slow engine from a
slow host.
"""

from __future__ import annotations

import time

import torch

#: 64 MiB of float32: eight times the L3 of the hosts seen here, so each sum reads DRAM.
PROBE_ELEMENTS = 16 * 1024 * 1024


def memory_read_gbs(repeats: int = 8) -> float:
    """GB/s of the fastest of ``repeats`` sums of a 64 MiB float32 tensor, on the current
    torch threads (a benchmark calls it with its own thread count set)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    data = torch.ones(PROBE_ELEMENTS)
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        fastest = min(fastest, time.perf_counter() - start)
    return data.numel() * data.element_size() / fastest / 1e9
