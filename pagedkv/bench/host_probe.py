"""How fast the host reads memory, and whether its CPUs all run, measured the same way at a
benchmark's start and end.

:mod:`pagedkv.bench.machine_load` sees the processes of this machine only. On a virtual machine
the other tenants of the host share its DRAM and L3, and their traffic moves every engine's
figures without a trace in ``/proc/stat``: on the Zen 1 host of 2026-12-03 a tensor sum read
20.5 GB/s at 17:30 UTC and 14.4 GB/s at 18:12, while a loop of multiply-adds kept its 80
GFLOP/s, and pagedkv's mixed float32 run moved 323-433 tokens/s on the same code. From ~18:10
UTC the same host ran short parallel regions on two threads no faster than on one (a hot GEMM of 16-32 rows:
34-38 GFLOP/s on two threads against 70-75 before), while a long loop of multiply-adds still
scaled: the hypervisor ran the second vCPU only part of the time, and no steal time showed. The
benchmark prints both figures at both ends of its run, so that a reader can tell a slow engine
from a slow host.
"""

from __future__ import annotations

import time

import torch

#: A GEMM small enough that one call is a short parallel region, as an engine step's are.
SCALING_SHAPE = (32, 512, 512)  # rows, k, columns
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


def _fastest_call(fn, calls: int, repeats: int) -> float:
    fn()  # warm: the first call pays for the threads' start and the caches
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        fastest = min(fastest, (time.perf_counter() - start) / calls)
    return fastest


def parallel_speedup(threads: int, repeats: int = 3) -> float | None:
    """How many times faster a small float32 GEMM (:data:`SCALING_SHAPE`) runs on ``threads``
    torch threads than on one; None for one thread. Near ``threads`` on a healthy host, near 1
    when the other CPUs are not really there. The torch thread count is restored."""
    if threads < 2:
        return None
    rows, k, columns = SCALING_SHAPE
    a, b = torch.ones(rows, k), torch.ones(k, columns)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fastest_call(lambda: torch.mm(a, b), 20, repeats)
        torch.set_num_threads(threads)
        many = _fastest_call(lambda: torch.mm(a, b), 20, repeats)
    finally:
        torch.set_num_threads(previous)
    return one / many


def host_state(end: str) -> dict[str, float | None]:
    """Both figures on the current torch threads, keyed ``..._<end>`` (``start`` or ``end``)."""
    return {
        f"memory_read_gbs_{end}": memory_read_gbs(),
        f"parallel_speedup_{end}": parallel_speedup(torch.get_num_threads()),
    }
