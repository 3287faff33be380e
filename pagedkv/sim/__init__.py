"""Naive (contiguous) vs paged KV memory on the same seeded workloads.

The paged side is the real :mod:`pagedkv.memory` allocator; see :mod:`pagedkv.sim.simulate` for
the experiments and :mod:`pagedkv.sim.plots` (matplotlib, imported on demand) for the figures.
"""

from pagedkv.sim.simulate import SimConfig, SimResult, simulate
from pagedkv.sim.workloads import WORKLOAD_NAMES, Request, Workload

__all__ = ["WORKLOAD_NAMES", "Request", "SimConfig", "SimResult", "Workload", "simulate"]
