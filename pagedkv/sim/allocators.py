"""Contiguous KV baselines: each request gets one unbroken run of slots, placed first-fit.

This is how a cache works without paging (Orca, FasterTransformer): the request's whole region
must be reserved up front, because it cannot grow into memory that someone else holds. Three
reservation policies, as in Figure 2 of the PagedAttention paper:

* ``max``    -- reserve ``max_seq_len`` slots (the length is unknown up front): the naive system;
* ``pow2``   -- reserve the next power of two of the final length (capped at ``max_seq_len``);
* ``oracle`` -- reserve exactly the final length (needs to know the future; a lower bound).

Placement is on a real linear address space, first fit, so the holes that requests leave behind
when they finish -- external fragmentation -- happen here as they would on a GPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from pagedkv.sim.workloads import Request

CONTIGUOUS_POLICIES = ("max", "pow2", "oracle")

# The top of an address space without a capacity: larger than any simulated footprint.
_UNBOUNDED = 1 << 62


def reservation_slots(policy: str, request: Request, max_seq_len: int) -> int:
    """Slots the contiguous ``policy`` reserves for ``request`` when it is admitted."""
    if request.final_len > max_seq_len:
        raise ValueError(f"request of {request.final_len} tokens exceeds max_seq_len={max_seq_len}")
    if policy == "max":
        return max_seq_len
    if policy == "pow2":
        return min(1 << (request.final_len - 1).bit_length(), max_seq_len)
    if policy == "oracle":
        return request.final_len
    raise ValueError(f"unknown contiguous policy {policy!r}; choose one of {', '.join(CONTIGUOUS_POLICIES)}")


class FirstFitSpace:
    """A linear range of slots ``[0, capacity)``; each allocation takes the lowest hole that fits.

    Holes are kept sorted by address and merged with their neighbours on free, so an allocation
    scans at most (live allocations + 1) holes.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"address space capacity must be positive, got {capacity!r}")
        self.capacity = _UNBOUNDED if capacity is None else capacity
        self._starts: list[int] = [0]
        self._ends: list[int] = [self.capacity]
        self.allocated = 0

    def allocate(self, size: int) -> int | None:
        """Start address of a new ``size``-slot region, or None if no hole is large enough."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size!r}")
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= size:
                if end - start == size:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + size
                self.allocated += size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        """Return ``[start, start + size)`` and merge it with adjacent holes."""
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + size) or (
            i > 0 and self._ends[i - 1] > start
        ):
            raise ValueError(f"region [{start}, {start + size}) overlaps a hole: double free?")
        self.allocated -= size
        merge_left = i > 0 and self._ends[i - 1] == start
        merge_right = i < len(self._starts) and self._starts[i] == start + size
        if merge_left and merge_right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif merge_left:
            self._ends[i - 1] = start + size
        elif merge_right:
            self._starts[i] = start
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, start + size)

    @property
    def footprint(self) -> int:
        """Slots up to the end of the highest allocation: the memory this layout needs."""
        if self._ends and self._ends[-1] == self.capacity:
            return self._starts[-1]
        return self.capacity

    @property
    def largest_hole(self) -> int:
        return max((e - s for s, e in zip(self._starts, self._ends, strict=True)), default=0)


@dataclass
class _Region:
    start: int
    size: int
    final_len: int


class ContiguousAllocator:
    """A reservation policy on a first-fit address space; requests are identified by a key."""

    def __init__(self, policy: str, max_seq_len: int, capacity_slots: int | None = None) -> None:
        if policy not in CONTIGUOUS_POLICIES:
            raise ValueError(
                f"unknown contiguous policy {policy!r}; choose one of {', '.join(CONTIGUOUS_POLICIES)}"
            )
        self.policy = policy
        self.max_seq_len = max_seq_len
        self.space = FirstFitSpace(capacity_slots)
        self._regions: dict[int, _Region] = {}
        self.final_total = 0

    def try_allocate(self, key: int, request: Request) -> bool:
        """Reserve the policy's region for ``request``; False (nothing changes) if none fits."""
        if key in self._regions:
            raise ValueError(f"request key {key} already holds a region")
        size = reservation_slots(self.policy, request, self.max_seq_len)
        start = self.space.allocate(size)
        if start is None:
            return False
        self._regions[key] = _Region(start, size, request.final_len)
        self.final_total += request.final_len
        return True

    def free(self, key: int) -> None:
        region = self._regions.pop(key)
        self.space.free(region.start, region.size)
        self.final_total -= region.final_len

    def region(self, key: int) -> tuple[int, int]:
        """(start, size) of the region held by ``key``."""
        region = self._regions[key]
        return region.start, region.size

    @property
    def num_live(self) -> int:
        return len(self._regions)

    @property
    def reserved_slots(self) -> int:
        return self.space.allocated
