"""How busy the machine was while a benchmark ran: the line every ``pagedkv bench`` report ends with.

Timings taken on a shared machine are only as good as its quiet. :class:`LoadMeter` reports the
share of the CPUs that processes other than this one and its children used during the run (all
CPU time /proc/stat counted, minus this process tree's own) and the load average before and
after; Linux only, elsewhere the figures are None. On a virtual machine the other tenants of the
host share its DRAM and its CPUs without a trace in /proc/stat, so :func:`host_state` also
measures, at a run's start and end, how fast a large tensor sum reads memory and how much faster
a small GEMM runs on the run's threads than on one: a reader can then tell a slow engine from a
slow host.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from rich.console import Console

#: A GEMM small enough that one call is a short parallel region, as an engine step's are.
SCALING_SHAPE = (32, 512, 512)  # rows, k, columns
#: 64 MiB of float32: larger than the last-level cache of common CPUs, so each sum reads DRAM.
PROBE_ELEMENTS = 16 * 1024 * 1024


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (not idle, not iowait)."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """This process and its waited-for children (rival workers), user + system."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class LoadMeter:
    """Start it before a run, ``stop()`` after: what else the machine did meanwhile."""

    wall: float = field(default_factory=time.perf_counter)
    busy: float | None = field(default_factory=_busy_cpu_seconds)
    own: float = field(default_factory=_own_cpu_seconds)
    loadavg: float = field(default_factory=lambda: os.getloadavg()[0])

    def stop(self) -> dict:
        wall = time.perf_counter() - self.wall
        busy = _busy_cpu_seconds()
        cpus = os.cpu_count() or 1
        other = None
        if busy is not None and self.busy is not None and wall > 0:
            # /proc/stat counts clock ticks: over a run of a few ticks the share reads coarsely
            other = min(1.0, max(0.0, (busy - self.busy) - (_own_cpu_seconds() - self.own)) / (wall * cpus))
        return {
            "cpus": cpus,
            "other_cpu_share": other,
            "loadavg_1min_start": self.loadavg,
            "loadavg_1min_end": os.getloadavg()[0],
            "wall_s": wall,
        }


def _fastest(fn, calls: int, repeats: int) -> float:
    """Seconds per call of the fastest of ``repeats`` rounds of ``calls`` calls (after a warm one)."""
    fn()
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        fastest = min(fastest, (time.perf_counter() - start) / calls)
    return fastest


def memory_read_gbs(repeats: int = 8) -> float:
    """GB/s of the fastest of ``repeats`` sums of a 64 MiB float32 tensor, on the current
    torch threads (a benchmark calls it with its own thread count set)."""
    import torch

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    data = torch.ones(PROBE_ELEMENTS)
    return data.numel() * data.element_size() / _fastest(data.sum, 1, repeats) / 1e9


def parallel_speedup(threads: int, repeats: int = 3) -> float | None:
    """How many times faster a small float32 GEMM (:data:`SCALING_SHAPE`) runs on ``threads``
    torch threads than on one; None for one thread. Near ``threads`` on a healthy host, near 1
    when the other CPUs are not really there. The torch thread count is restored."""
    import torch

    if threads < 2:
        return None
    rows, k, columns = SCALING_SHAPE
    a, b = torch.ones(rows, k), torch.ones(k, columns)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fastest(lambda: torch.mm(a, b), 20, repeats)
        torch.set_num_threads(threads)
        many = _fastest(lambda: torch.mm(a, b), 20, repeats)
    finally:
        torch.set_num_threads(previous)
    return one / many


def host_state(end: str) -> dict[str, float | int | None]:
    """Both probes on the current torch threads, keyed ``..._<end>`` (``start`` or ``end``)."""
    import torch

    threads = torch.get_num_threads()
    return {
        "threads": threads,
        f"memory_read_gbs_{end}": memory_read_gbs(),
        f"parallel_speedup_{end}": parallel_speedup(threads),
    }


def print_host(machine: dict, console: Console) -> None:
    """The host's lines under a report: other work during the run and, when probed, the host's state."""
    line = f"wall time {machine['wall_s']:.0f} s"
    if machine.get("other_cpu_share") is not None:
        loadavg = f"{machine['loadavg_1min_start']:.1f} -> {machine['loadavg_1min_end']:.1f}"
        line += (
            f"; other work on this machine meanwhile: {machine['other_cpu_share']:.0%} of its "
            f"{machine['cpus']} CPUs (1-min load average {loadavg})"
        )
    console.print(line)
    if machine.get("memory_read_gbs_start") is not None:
        console.print(
            f"memory read rate, start -> end: {machine['memory_read_gbs_start']:.1f} -> "
            f"{machine['memory_read_gbs_end']:.1f} GB/s (a 64 MiB tensor sum; other tenants of a shared "
            "host show here, not above)"
        )
    if machine.get("parallel_speedup_start") is not None:
        console.print(
            f"a small GEMM on {machine['threads']} threads against one, start -> end: "
            f"{machine['parallel_speedup_start']:.2f}x -> {machine['parallel_speedup_end']:.2f}x (near 1x: "
            "the other CPUs were not really there)"
        )
