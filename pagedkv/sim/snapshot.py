"""Experiment (a): N requests in flight, and where each allocator's memory goes.

How the moments are chosen (this decides what "used" means): a closed loop keeps exactly N
requests running. It starts from N requests at uniformly random progress through their outputs
(``k ~ U{0, .., output_len - 1}`` tokens generated). Each step every request generates one token;
a request that finishes is replaced at once by the workload's next request (prefilled, nothing
generated yet), placed first-fit in each contiguous allocator's address space. After a warm-up of
``2 * max_seq_len`` steps every initial request has been replaced and the holes left by finished
requests have spread through the contiguous address spaces; from then on the loop is observed
``moments`` times, ``max_seq_len`` steps apart. Each moment is the batch a server running N
requests at a time holds at an arbitrary instant (long requests are in flight more often than
short ones, as in a real server). The reported breakdown is the mean over the moments, so that
small batches give a stable figure rather than one draw.

"Used" (token states) is each request's prompt plus the tokens it has generated so far. The
contiguous address spaces are unbounded: their memory is the footprint (end of the highest
region), and the holes below it are external fragmentation. The paged side holds the same
requests in a real :class:`BlockPool`.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from pagedkv.sim.allocators import CONTIGUOUS_POLICIES, ContiguousAllocator
from pagedkv.sim.breakdown import Breakdown
from pagedkv.sim.paged import paged_breakdown
from pagedkv.sim.workloads import LiveRequest, Request, Workload

ALLOCATORS = (*CONTIGUOUS_POLICIES, "paged")


class ClosedLoop:
    """Exactly ``batch_size`` requests running; each finished one is replaced by the next."""

    def __init__(self, workload: Workload, batch_size: int, rng: np.random.Generator) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
        stream_rng, progress_rng = rng.spawn(2)
        self._stream = workload.stream(stream_rng)
        self.allocators = {p: ContiguousAllocator(p, workload.max_seq_len) for p in CONTIGUOUS_POLICIES}
        self._running: dict[int, tuple[Request, int]] = {}  # key -> (request, step it had generated 0)
        self._finishes: list[tuple[int, int]] = []  # heap of (step at which it is done, key)
        self._keys = itertools.count()
        self.now = 0
        for request in itertools.islice(self._stream, batch_size):
            self._admit(request, -int(progress_rng.integers(0, request.output_len)))

    def _admit(self, request: Request, start: int) -> None:
        key = next(self._keys)
        self._running[key] = (request, start)
        for allocator in self.allocators.values():
            allocator.try_allocate(key, request)  # unbounded address space: always fits
        heapq.heappush(self._finishes, (start + request.output_len, key))

    def advance_to(self, step: int) -> None:
        """Run the loop up to ``step``; requests done by then are replaced."""
        while self._finishes[0][0] <= step:
            done_at, key = heapq.heappop(self._finishes)
            for allocator in self.allocators.values():
                allocator.free(key)
            del self._running[key]
            self._admit(next(self._stream), done_at)
        self.now = step

    def live(self) -> list[LiveRequest]:
        return [LiveRequest(req, req.prompt_len + self.now - start) for req, start in self._running.values()]


def contiguous_breakdown(live: list[LiveRequest], allocator: ContiguousAllocator) -> Breakdown:
    """Split ``allocator``'s footprint holding ``live`` into the Figure-2 categories."""
    tokens = sum(r.tokens for r in live)
    finals = sum(r.request.final_len for r in live)
    reserved = allocator.reserved_slots
    return Breakdown(
        token_states=tokens,
        reservation=finals - tokens,
        internal_fragmentation=reserved - finals,
        external_fragmentation=allocator.space.footprint - reserved,
    )


@dataclass(frozen=True)
class Snapshot:
    """Per allocator (``ALLOCATORS``), the mean breakdown in slots over the observed moments."""

    batch_size: int
    moments: tuple[tuple[LiveRequest, ...], ...]
    breakdowns: dict[str, Breakdown]


def take_snapshot(
    workload: Workload, batch_size: int, block_size: int, rng: np.random.Generator, moments: int = 8
) -> Snapshot:
    if moments <= 0:
        raise ValueError(f"need at least one moment to observe, got {moments!r}")
    loop = ClosedLoop(workload, batch_size, rng)
    totals = dict.fromkeys(ALLOCATORS, Breakdown(0))
    observed = []
    for i in range(moments):
        loop.advance_to((2 + i) * workload.max_seq_len)
        live = loop.live()
        observed.append(tuple(live))
        for name, allocator in loop.allocators.items():
            totals[name] += contiguous_breakdown(live, allocator)
        totals["paged"] += paged_breakdown(live, block_size)[0]
    return Snapshot(batch_size, tuple(observed), {k: v.scaled(1 / moments) for k, v in totals.items()})
