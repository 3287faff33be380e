"""Experiment (b): a dynamic trace through a fixed KV memory, for each allocator.

Requests arrive as a Poisson process and wait in a FIFO queue. At each step, in this order:

1. requests that are done leave and free their memory;
2. every running request stores one more token (paged: a new block on each block boundary; if
   the pool is empty, the most recently admitted request is preempted -- its blocks are freed
   and it returns to the head of the queue, to be recomputed from its stored tokens, as vLLM
   does);
3. this step's arrivals join the queue;
4. the queue is admitted in order until its head does not fit (contiguous: no hole for its
   reservation; paged: fewer free blocks than its prefill plus a 1 % watermark; no admission in a
   step that preempted). An admitted request is prefilled at once;
5. memory is accounted.

A request admitted at step ``a`` holding ``c`` tokens holds ``c + (t - a)`` at step ``t`` and
leaves at the step its final token is due. Nothing iterates over tokens: contiguous memory only
changes on admission and exit, and a paged table only on block boundaries, so both loops jump
from event to event through heaps (a paged table is grown by all the tokens since its last block
in one ``append_slots`` call, which takes exactly the blocks that per-token calls would take).

The time-averaged breakdown covers the whole memory: free slots count as external fragmentation
while a request waits (memory exists but cannot be used) and as free otherwise. Utilization is
token states over the memory that is not idle (everything but free).

Besides the averages, a run keeps what a replay needs to redraw its memory at any step: per-step
series (running, stored, held, waiting) and one :class:`Residency` per admission.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from pagedkv.memory import BlockPool, BlockTable, PoolExhaustedError, blocks_for
from pagedkv.sim.allocators import ContiguousAllocator
from pagedkv.sim.breakdown import Breakdown
from pagedkv.sim.workloads import Request

#: Fraction of the pool kept free at admission so that running requests can grow.
WATERMARK = 0.01


@dataclass(frozen=True)
class Residency:
    """One admission of a request: where it sat in memory from step ``admitted`` until ``left``.

    At each step ``admitted <= t < left`` it stores ``tokens + (t - admitted)`` tokens (``left``
    is the trace's length if it was still running at the end). Contiguous: ``placement`` is the
    ``(start, size)`` of its region. Paged: its block ids in table order, of which it holds the
    first ``blocks_for(stored tokens, block_size)`` at each step, because a table only grows, one
    block at each boundary. A preempted request has one residency per admission.
    """

    request: int  # index into the arrivals
    admitted: int
    left: int
    tokens: int
    final_len: int
    placement: tuple[int, ...]

    def stored_at(self, step: int) -> int:
        """Tokens stored at ``step`` (a request that has all its tokens keeps them until it leaves)."""
        return min(self.tokens + step - self.admitted, self.final_len)


@dataclass(frozen=True)
class TraceResult:
    """One allocator's run: time-averaged slot breakdown and request counts, and per step what it
    held (``stored`` token slots, ``held`` slots, ``waiting`` requests) for plots and replays."""

    allocator: str
    capacity_slots: int
    breakdown: Breakdown
    peak_running: int
    mean_running: float
    completed: int
    preemptions: int
    running: list[int] = field(repr=False)
    stored: list[int] = field(repr=False)
    held: list[int] = field(repr=False)
    waiting: list[int] = field(repr=False)
    residencies: tuple[Residency, ...] = field(repr=False)

    def to_json(self, bytes_per_token: int) -> dict:
        return {
            "kv_memory_bytes": self.capacity_slots * bytes_per_token,
            "fractions": self.breakdown.fractions(),
            "token_state_fraction": self.breakdown.fractions()["token_states"],
            "utilization": self.breakdown.utilization,
            "peak_running": self.peak_running,
            "mean_running": self.mean_running,
            "completed": self.completed,
            "preemptions": self.preemptions,
        }


class _Accounting:
    """Accumulates per-step slot counts into time averages."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sums = [0.0] * 5
        self.running: list[int] = []
        self.stored: list[int] = []
        self.held: list[int] = []
        self.waiting: list[int] = []
        self.residencies: list[Residency] = []

    def record(self, running: int, tokens: int, reservation: int, reserved: int, waiting: int) -> None:
        """One step: ``reserved`` slots are held, of which ``tokens`` are stored and
        ``reservation`` are held for tokens still to come; the rest of the held slots is internal
        fragmentation. ``waiting`` requests are queued."""
        free = self.capacity - reserved
        internal = reserved - tokens - reservation
        step = (tokens, reservation, internal, free if waiting else 0, 0 if waiting else free)
        self.sums = [s + v for s, v in zip(self.sums, step, strict=True)]
        self.running.append(running)
        self.stored.append(tokens)
        self.held.append(reserved)
        self.waiting.append(waiting)

    def result(self, allocator: str, completed: int, preemptions: int) -> TraceResult:
        steps = len(self.running)
        return TraceResult(
            allocator=allocator,
            capacity_slots=self.capacity,
            breakdown=Breakdown(*(s / steps for s in self.sums)),
            peak_running=max(self.running),
            mean_running=sum(self.running) / steps,
            completed=completed,
            preemptions=preemptions,
            running=self.running,
            stored=self.stored,
            held=self.held,
            waiting=self.waiting,
            residencies=tuple(sorted(self.residencies, key=lambda r: (r.admitted, r.request))),
        )


def _arrivals_by_step(arrivals: list[tuple[int, Request]]) -> dict[int, list[int]]:
    by_step: dict[int, list[int]] = {}
    for key, (step, _) in enumerate(arrivals):
        by_step.setdefault(step, []).append(key)
    return by_step


def _check(arrivals: list[tuple[int, Request]], capacity_slots: int, max_seq_len: int, steps: int) -> None:
    if capacity_slots < max_seq_len:
        raise ValueError(
            f"the KV memory holds {capacity_slots} tokens, less than one {max_seq_len}-token request"
        )
    if steps <= 0:
        raise ValueError(f"a trace needs at least one step, got {steps!r}")
    if any(r.final_len > max_seq_len for _, r in arrivals):
        raise ValueError(f"a request exceeds max_seq_len={max_seq_len}")


def run_contiguous(
    policy: str, arrivals: list[tuple[int, Request]], capacity_slots: int, max_seq_len: int, steps: int
) -> TraceResult:
    """Replay ``arrivals`` ((step, request), sorted by step) on a first-fit contiguous memory."""
    _check(arrivals, capacity_slots, max_seq_len, steps)
    allocator = ContiguousAllocator(policy, max_seq_len, capacity_slots)
    by_step = _arrivals_by_step(arrivals)
    waiting: deque[int] = deque()
    finishes: list[tuple[int, int]] = []
    base = 0  # sum over running requests of (prompt_len - admission step): tokens = base + n * t
    completed = 0
    admitted: dict[int, int] = {}  # running key -> step it was admitted
    books = _Accounting(capacity_slots)

    def residency(key: int, left: int) -> Residency:
        request = arrivals[key][1]
        start = admitted.pop(key)
        return Residency(key, start, left, request.prompt_len, request.final_len, allocator.region(key))

    for t in range(steps):
        while finishes and finishes[0][0] == t:
            _, key = heapq.heappop(finishes)
            books.residencies.append(residency(key, t))
            allocator.free(key)
            base -= arrivals[key][1].prompt_len - (t - arrivals[key][1].output_len)
            completed += 1
        waiting.extend(by_step.get(t, ()))
        while waiting and allocator.try_allocate(waiting[0], arrivals[waiting[0]][1]):
            key = waiting.popleft()
            request = arrivals[key][1]
            heapq.heappush(finishes, (t + request.output_len, key))
            admitted[key] = t
            base += request.prompt_len - t
        n = allocator.num_live
        tokens = base + n * t
        books.record(n, tokens, allocator.final_total - tokens, allocator.reserved_slots, len(waiting))
    books.residencies.extend(residency(key, steps) for key in list(admitted))
    return books.result(policy, completed, preemptions=0)


@dataclass
class _Seq:
    """A running paged request: ``tokens`` stored when admitted at step ``admitted``."""

    table: BlockTable
    tokens: int
    admitted: int
    epoch: int  # bumped on preemption, so that stale heap entries are recognised


def run_paged(
    arrivals: list[tuple[int, Request]], num_blocks: int, block_size: int, max_seq_len: int, steps: int
) -> TraceResult:
    """Replay ``arrivals`` on a :class:`BlockPool` of ``num_blocks`` blocks."""
    _check(arrivals, num_blocks * block_size, max_seq_len, steps)
    pool = BlockPool(num_blocks, block_size)
    watermark = math.ceil(WATERMARK * num_blocks)
    by_step = _arrivals_by_step(arrivals)
    waiting: deque[int] = deque()
    resume = [r.prompt_len for _, r in arrivals]  # tokens to prefill on (re)admission
    epochs = [0] * len(arrivals)
    running: dict[int, _Seq] = {}  # insertion order = admission order: the last is the victim
    finishes: list[tuple[int, int, int]] = []  # (step, epoch, key)
    boundaries: list[tuple[int, int, int]] = []  # (step a new block is needed, epoch, key)
    base = 0  # sum over running of (tokens at admission - admission step)
    completed = preemptions = 0
    books = _Accounting(num_blocks * block_size)

    def next_boundary(key: int) -> None:
        seq = running[key]
        step = seq.admitted + seq.table.capacity + 1 - seq.tokens
        heapq.heappush(boundaries, (step, seq.epoch, key))

    def leave(key: int, step: int) -> None:
        nonlocal base
        seq = running.pop(key)
        placement = tuple(seq.table.block_ids)
        books.residencies.append(
            Residency(key, seq.admitted, step, seq.tokens, arrivals[key][1].final_len, placement)
        )
        seq.table.free()
        base -= seq.tokens - seq.admitted
        epochs[key] += 1

    for t in range(steps):
        while finishes and finishes[0][0] == t:
            _, epoch, key = heapq.heappop(finishes)
            if epoch == epochs[key]:
                leave(key, t)
                completed += 1
        preempted = False
        while boundaries and boundaries[0][0] == t:
            _, epoch, key = heapq.heappop(boundaries)
            if epoch != epochs[key]:
                continue
            seq = running[key]
            want = seq.tokens + t - seq.admitted
            while True:
                try:
                    seq.table.append_slots(want - seq.table.num_tokens)
                    next_boundary(key)
                    break
                except PoolExhaustedError:
                    victim = next(reversed(running))
                    resume[victim] = running[victim].tokens + t - 1 - running[victim].admitted
                    leave(victim, t)
                    waiting.appendleft(victim)
                    preemptions += 1
                    preempted = True
                    if victim == key:
                        break
        waiting.extend(by_step.get(t, ()))
        while waiting and not preempted:
            key = waiting[0]
            tokens = resume[key]
            if pool.num_free_blocks - blocks_for(tokens, block_size) < watermark:
                break
            waiting.popleft()
            table = BlockTable(pool)
            table.append_slots(tokens)
            running[key] = _Seq(table, tokens, t, epochs[key])
            base += tokens - t
            heapq.heappush(finishes, (t + arrivals[key][1].final_len - tokens, epochs[key], key))
            next_boundary(key)
        n = len(running)
        books.record(n, base + n * t, 0, pool.num_used_blocks * block_size, len(waiting))
    for key in list(running):
        leave(key, steps)
    return books.result("paged", completed, preemptions)
