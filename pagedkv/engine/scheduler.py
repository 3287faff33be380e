"""Continuous batching: which sequences run this step, and how many tokens each computes.

Every step the scheduler first serves the running sequences (decodes, then unfinished prompt
chunks), then admits waiting ones while the token budget, the sequence budget and the KV cache
allow. New requests join and finished ones leave at every step. A long prompt is computed in
chunks so it never stalls the running decodes for a whole prompt's worth of compute.

The KV policy (:mod:`pagedkv.engine.kv_policy`) decides what admission reserves: ``paged`` the
prompt's blocks, the contiguous policies a whole reservation up front. Under ``paged`` a request
is also admitted only while the running requests keep room to grow
(:mod:`pagedkv.engine.headroom`), so an offline batch does not over-commit the pool.

When a running sequence still needs a block and the pool is empty, the most recently admitted
running sequence is preempted by recompute: its blocks go back to the pool and it returns to
the front of the waiting queue; when readmitted, prefix caching usually finds its blocks again.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedkv.engine.executor.plan import SeqSlice, StepPlan
from pagedkv.engine.headroom import Headroom, Projection, Refusal
from pagedkv.engine.kv_policy import PAGED, KVPolicy
from pagedkv.engine.sequence import Sequence, SequenceStatus
from pagedkv.memory import KVCacheManager

logger = logging.getLogger("pagedkv.scheduler")


@dataclass(frozen=True)
class ScheduledSeq:
    """A sequence and the slice ``start:end`` of its tokens this step computes.

    Fixed when scheduled: the sequence itself moves on after the step.
    """

    seq: Sequence
    start: int
    end: int
    #: The slice reaches the sequence's last token, so its logits are sampled.
    needs_logits: bool

    @classmethod
    def next_chunk(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        return cls(seq, start, end, end == seq.num_tokens and seq.finish_reason is None)

    @property
    def num_new_tokens(self) -> int:
        return self.end - self.start


@dataclass
class SchedulerOutput:
    """One step's work as the scheduler decided it: the token slices to compute (with the block
    copies due before them) and the sequences preempted to make room. The engine turns it into
    the executor's plan and, after the forward pass, samples the slices that need logits."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    #: Copy-on-write block copies to perform before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    #: Computed tokens the preempted sequences lost: they compute them again.
    dropped_tokens: int = 0
    #: Prompt tokens looked up in, and served by, the prefix cache at this step's admissions.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: Blocks held once the step's slots and copies are allocated: what its forward pass needs.
    kv_blocks_used: int = 0
    #: Blocks the live block tables reference then, a shared block once per holder (what the
    #: same sequences would hold without sharing).
    kv_table_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def plan(self, kv_manager: KVCacheManager) -> StepPlan:
        """The executor's record of this step: token slices, block tables (copied: the tables
        move on) and the block copies, as plain data."""
        slices = [
            SeqSlice(
                token_ids=item.seq.token_ids[item.start : item.end],
                start=item.start,
                block_table=list(kv_manager.block_ids(item.seq.seq_id)),
                needs_logits=item.needs_logits,
                prompt_logits=item.seq.needs_prompt_logits,
                prompt_len=item.seq.prompt_len,
            )
            for item in self.scheduled
        ]
        return StepPlan(slices, list(self.block_copies))


class Scheduler:
    """Continuous batching over one KV pool (see the module docstring).

    It owns the waiting and running queues and is the only caller of the
    :class:`~pagedkv.memory.KVCacheManager` during a step: admission, growth, preemption, forks
    and frees all go through it, so the queues and the block tables never disagree.
    """

    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_policy: KVPolicy = PAGED,
        max_model_len: int = 2048,
        decode_headroom: float = 1.0,
    ) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be positive, "
                f"got {max_num_seqs} and {max_num_batched_tokens}"
            )
        if not 0.0 <= decode_headroom <= 1.0:
            raise ValueError(f"decode_headroom must be in [0, 1], got {decode_headroom}")
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        #: In admission order: the last one is the first to be preempted.
        self.running: list[Sequence] = []
        self._preempted_before = False
        self.kv_policy = kv_policy
        self.max_model_len = max_model_len
        #: Block copies requested between steps (a non-sharing fork) for the next step.
        self.pending_copies: list[tuple[int, int]] = []
        #: Keeps the running requests' growth free at admission; None: prompt blocks only
        #: (``decode_headroom=0``, or a policy that reserves everything up front anyway).
        self.headroom: Headroom | None = None
        #: The waiting head admission last refused, and by how much: until a block comes back
        #: the verdict stands for a while (:class:`~pagedkv.engine.headroom.Refusal`), and the
        #: steps in between skip projecting the running set.
        self._refusal: Refusal | None = None
        #: This step's admission stopped at a waiting request whose blocks did not fit, with
        #: room left in the batch: the KV pool, not the batch size, kept it waiting.
        self.admission_blocked_by_kv = False
        if decode_headroom and kv_policy.grows_on_demand:
            self.headroom = Headroom(kv_manager, decode_headroom, max_num_batched_tokens, max_model_len)

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def reserve_tokens(self, seq: Sequence) -> int:
        """Slots to hold for ``seq`` at admission, beyond its current tokens."""
        max_tokens = seq.request.params.max_tokens
        return self.kv_policy.reserved_tokens(seq.prompt_len, max_tokens, self.max_model_len)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a new sample or beam of ``parent``'s request) gets ``parent``'s blocks --
        shared, or copied at the next step when the policy does not share -- and runs."""
        share = self.kv_policy.shares_blocks
        self.pending_copies.extend(self.kv_manager.fork(parent.seq_id, child.seq_id, share=share))
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` from whichever queue holds it and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.kv_manager.free(seq.seq_id)
        self._refusal = None  # blocks came back: the head may fit now

    def cache_computed_blocks(self, seqs: Iterable[Sequence]) -> None:
        """Offer the full blocks these sequences computed this step to the prefix cache (only
        now that their keys and values are really in the cache)."""
        allocatable = self.kv_manager.allocatable_blocks
        for seq in seqs:
            self.kv_manager.cache_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if self.kv_manager.allocatable_blocks > allocatable:
            self._refusal = None  # a sequence gave its copy of a block up for one cached first

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_to_admit(self, seq: Sequence) -> int:
        use_cache = not seq.needs_prompt_logits  # a cached token has no logits to score it
        return self.kv_manager.blocks_to_allocate(seq.token_ids, self.reserve_tokens(seq), use_cache)

    def _shortfall(
        self, seq: Sequence, needed: int, budget: int, projection: Callable[[], Projection]
    ) -> int:
        """Blocks missing for ``seq``'s ``needed`` blocks to fit, and (with headroom) the running
        requests' growth with them (<= 0: it fits). With nothing running the prompt alone
        decides, so a request always makes progress. ``projection`` is only called when the
        prompt fits."""
        shortfall = needed - self.kv_manager.allocatable_blocks
        if shortfall > 0 or self.headroom is None or not self.running:
            return shortfall
        return projection().shortfall(seq, needed, budget)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=self.pending_copies)
        self.pending_copies = []
        queries, hits = self.kv_manager.prefix_query_tokens, self.kv_manager.prefix_hit_tokens
        budget = self._schedule_running(out)
        self._admit_waiting(out, budget)
        out.prefix_cache_queries = self.kv_manager.prefix_query_tokens - queries
        out.prefix_cache_hits = self.kv_manager.prefix_hit_tokens - hits
        out.kv_blocks_used = self.kv_manager.usage().used_blocks
        out.kv_table_blocks = self.kv_manager.num_table_blocks()
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Decodes first (they are cheap and keep inter-token latency steady), then unfinished
        prompt chunks; returns the token budget left."""
        budget = self.max_num_batched_tokens
        for seq in sorted(self.running, key=lambda s: s.in_prefill):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted while making room for an earlier one
            if seq.num_computed_tokens == seq.num_tokens:
                continue  # a beam waiting for its siblings: nothing to compute
            if seq.in_prefill:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            else:
                preempted = len(out.preempted)
                copies = self._make_room(seq, out)
                if len(out.preempted) != preempted:
                    budget = self.max_num_batched_tokens - out.num_tokens  # victims gave theirs back
                if copies is None:
                    continue
                out.block_copies.extend(copies)
                n = 1
            out.scheduled.append(ScheduledSeq.next_chunk(seq, n))
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order while the budgets and the KV pool allow."""
        projection: Projection | None = None

        def running_projection() -> Projection:
            # Built at most once a step, only when a prompt fits: a Growth per running sequence.
            nonlocal projection
            if projection is None:
                scheduled = {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}
                projection = self.headroom.projection(self.running, scheduled)
            return projection

        self.admission_blocked_by_kv = False
        if self._refusal is not None:
            self._refusal.steps += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            needed = self._blocks_to_admit(seq)
            if self._refusal is not None and self._refusal.stands(seq, budget, needed):
                self.admission_blocked_by_kv = True
                break
            shortfall = self._shortfall(seq, needed, budget, running_projection)
            if shortfall > 0:
                self._refusal = Refusal.of(seq, budget, needed, shortfall, self.headroom is not None)
                self.admission_blocked_by_kv = True
                break
            self._refusal = None
            self.waiting.popleft()
            reserve = self.reserve_tokens(seq)
            use_cache = not seq.needs_prompt_logits
            cached = self.kv_manager.allocate(seq.seq_id, seq.token_ids, reserve, use_cache)
            seq.num_computed_tokens = cached
            if seq.num_output_tokens == 0:
                seq.request.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - cached, budget)
            out.scheduled.append(ScheduledSeq.next_chunk(seq, n))
            if projection is not None:
                projection.add(seq, n)
            budget -= n

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> list[tuple[int, int]] | None:
        """Grow ``seq`` by one token, preempting the newest running sequences until it fits.

        Returns its copy-on-write block copies, or None if ``seq`` itself had to be preempted.
        """
        while (copies := self.kv_manager.try_append(seq.seq_id, 1)) is None:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return None
        return copies

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        lost = seq.num_computed_tokens
        self._refusal = None  # its blocks come back, and it heads the queue
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.kv_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.dropped_tokens += lost
        # The first preemption is worth a warning (the pool is too small for the load); every
        # one is logged, at INFO after that, so a busy server does not flood its stderr.
        log = logger.info if self._preempted_before else logger.warning
        self._preempted_before = True
        log(
            "preempted request %s (sample %d) by recompute: %d computed tokens dropped, "
            "%d KV blocks free of %d",
            seq.request.request_id,
            seq.index,
            lost,
            self.kv_manager.usage().free_blocks,
            self.kv_manager.num_blocks,
        )
