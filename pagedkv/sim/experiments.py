"""Experiments (c)-(f): block-size trade-off, prefix sharing, capacity, the worked example.

Each takes its requests from a seeded generator and measures the paged side on the real
:class:`BlockPool` / :class:`BlockTable`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.memory import BlockPool, BlockTable, PoolExhaustedError, blocks_for
from pagedkv.sim.allocators import CONTIGUOUS_POLICIES, ContiguousAllocator
from pagedkv.sim.paged import hold, paged_breakdown
from pagedkv.sim.workloads import LiveRequest, Request, Workload


def at_random_progress(requests: Sequence[Request], rng: np.random.Generator) -> list[LiveRequest]:
    """Each request after ``k ~ U{0, .., output_len - 1}`` generated tokens."""
    return [LiveRequest(r, r.prompt_len + int(rng.integers(0, r.output_len))) for r in requests]


# -- (c) block size ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockSizeRow:
    """Mean over the observed batches: slots wasted in last blocks, and block-table entries."""

    block_size: int
    wasted_slots: float
    table_entries: float
    held_slots: float

    @property
    def waste_fraction(self) -> float:
        return self.wasted_slots / self.held_slots if self.held_slots else 0.0


def block_size_sweep(
    batches: Sequence[Sequence[LiveRequest]], block_sizes: Sequence[int]
) -> list[BlockSizeRow]:
    """Small blocks waste little but need long tables (and more, smaller memory accesses)."""
    if not batches:
        raise ValueError("the block-size sweep needs at least one batch of requests")
    rows = []
    for block_size in block_sizes:
        measured = [paged_breakdown(batch, block_size) for batch in batches]
        n = len(measured)
        rows.append(
            BlockSizeRow(
                block_size=block_size,
                wasted_slots=sum(b.internal_fragmentation for b, _ in measured) / n,
                table_entries=sum(entries for _, entries in measured) / n,
                held_slots=sum(b.reserved for b, _ in measured) / n,
            )
        )
    return rows


# -- (d) prefix sharing --------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixSharing:
    num_requests: int
    prefix_len: int
    block_size: int
    blocks_without_sharing: int
    blocks_with_sharing: int
    shared_blocks: int
    cow_copies: int


def prefix_sharing(
    workload: Workload, num_requests: int, block_size: int, rng: np.random.Generator
) -> PrefixSharing:
    """``num_requests`` requests of a ``shared-prefix`` workload at random progress, held twice.

    Without sharing every request stores its own copy of the system prompt. With sharing the
    first request computes the prompt and the others fork its table: the prompt's full blocks are
    held once. The prompt's last, partial block is shared too until a request writes its own
    first token into it: that write copies the block (copy-on-write) for every request except the
    last one still holding the original, which writes in place.
    """
    if workload.name != "shared-prefix":
        raise ValueError(f"prefix sharing needs the shared-prefix workload, got {workload.name!r}")
    if num_requests <= 0:
        raise ValueError(f"prefix sharing needs at least one request, got {num_requests!r}")
    live = at_random_progress(workload.sample(rng, num_requests), rng)
    alone = paged_breakdown(live, block_size)[0].reserved // block_size

    pool = BlockPool(int(alone), block_size)
    first = BlockTable(pool)
    first.append_slots(workload.prefix_len)
    tables = [first] + [first.fork() for _ in live[1:]]
    copies = sum(
        len(t.append_slots(r.tokens - workload.prefix_len)) for t, r in zip(tables, live, strict=True)
    )
    return PrefixSharing(
        num_requests=num_requests,
        prefix_len=workload.prefix_len,
        block_size=block_size,
        blocks_without_sharing=int(alone),
        blocks_with_sharing=pool.num_used_blocks,
        shared_blocks=workload.prefix_len // block_size,
        cow_copies=copies,
    )


# -- (e) capacity --------------------------------------------------------------------------------
def capacity(workload: Workload, kv_slots: int, block_size: int, rng: np.random.Generator) -> dict[str, int]:
    """Requests that fit at once in ``kv_slots`` token slots, per allocator.

    Requests come from the workload at uniformly random progress (as in a running server) and are
    admitted in order until the first that does not fit: contiguous policies reserve their region
    in a first-fit space of ``kv_slots``; paged holds the stored tokens in a pool of
    ``kv_slots // block_size`` blocks.
    """
    stream_rng, progress_rng = rng.spawn(2)
    stream = workload.stream(stream_rng)
    drawn: list[LiveRequest] = []

    def nth(i: int) -> LiveRequest:
        while len(drawn) <= i:
            drawn.extend(at_random_progress([next(stream)], progress_rng))
        return drawn[i]

    def fits_paged(pool: BlockPool, live: LiveRequest) -> bool:
        try:
            hold(pool, live)
        except PoolExhaustedError:
            return False
        return True

    fits: dict[str, int] = {}
    for policy in CONTIGUOUS_POLICIES:
        allocator = ContiguousAllocator(policy, workload.max_seq_len, kv_slots)
        fits[policy] = next(i for i in itertools.count() if not allocator.try_allocate(i, nth(i).request))
    pool = BlockPool(kv_slots // block_size, block_size)
    fits["paged"] = next(i for i in itertools.count() if not fits_paged(pool, nth(i)))
    return fits


# -- (f) the worked example ----------------------------------------------------------------------
@dataclass(frozen=True)
class WorkedExample:
    """Requests of ``lengths`` tokens: contiguous regions (start, size) vs paged block ids."""

    lengths: tuple[int, ...]
    max_seq_len: int
    block_size: int
    regions: tuple[tuple[int, int], ...]
    block_ids: tuple[tuple[int, ...], ...]

    @property
    def naive_slots(self) -> int:
        return sum(size for _, size in self.regions)

    @property
    def paged_slots(self) -> int:
        return sum(len(ids) for ids in self.block_ids) * self.block_size

    @property
    def ratio(self) -> float:
        return self.naive_slots / self.paged_slots


def worked_example(
    lengths: Sequence[int] = (25, 47, 12), max_seq_len: int = 2048, block_size: int = 16
) -> WorkedExample:
    """Each request is reserved ``max_seq_len`` slots contiguously; paged, the three grow one
    token at a time in turn (as a decode batch does), so their blocks interleave in the pool."""
    if not lengths or any(not 0 < n <= max_seq_len for n in lengths):
        raise ValueError(f"example lengths must be in [1, {max_seq_len}], got {list(lengths)}")
    naive = ContiguousAllocator("max", max_seq_len)
    for key, n in enumerate(lengths):
        naive.try_allocate(key, Request(prompt_len=n, output_len=0))
    pool = BlockPool(sum(blocks_for(n, block_size) for n in lengths), block_size)
    tables = [BlockTable(pool) for _ in lengths]
    for step in range(max(lengths)):
        for table, n in zip(tables, lengths, strict=True):
            if step < n:
                table.append_slots(1)
    return WorkedExample(
        lengths=tuple(lengths),
        max_seq_len=max_seq_len,
        block_size=block_size,
        regions=tuple(naive.region(key) for key in range(len(lengths))),
        block_ids=tuple(tuple(t.block_ids) for t in tables),
    )
