"""How busy the machine was with *other* work while a benchmark ran.

Timings taken on a shared machine are only as good as its quiet: a benchmark reports, next to
its figures, the share of the CPUs that processes other than itself and its children used
during the run (all CPU time the kernel counted in /proc/stat, minus this process tree's own),
and the load average before and after. Linux only; elsewhere the figures are None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


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
            other = max(0.0, (busy - self.busy) - (_own_cpu_seconds() - self.own)) / (wall * cpus)
        return {
            "cpus": cpus,
            "other_cpu_share": other,
            "loadavg_1min_start": self.loadavg,
            "loadavg_1min_end": os.getloadavg()[0],
        }
