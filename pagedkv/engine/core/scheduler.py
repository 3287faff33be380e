"""Continuous batching: which sequences run this step, and how many tokens each computes.

Every step the scheduler first serves the running sequences (decodes and the tokens they
proposed, then unfinished prompt chunks), then admits waiting ones while the token budget, the
sequence budget and the KV cache allow. New requests join and finished ones leave at every step.
A long prompt is computed in chunks, never stalling the running decodes for a whole prompt.

The KV policy (:mod:`pagedkv.engine.core.kv_policy`) decides what admission reserves: ``paged`` the
prompt's blocks, the contiguous policies a whole reservation up front. Under ``paged`` a request
is also admitted only while the running requests keep room to grow
(:mod:`pagedkv.engine.core.headroom`), so an offline batch does not over-commit the pool.

Which waiting sequence goes in first, and how much of the engine one client request may hold
while others wait, is fair admission (:mod:`pagedkv.engine.core.fairness`): fewest running slots
first, at most ``max_running_share`` of the slots and blocks per client request while others
wait, and what a request over its share holds is taken back for one within it.

When a running sequence still needs a block and the pool is empty, a running sequence is
preempted -- one of a request over its share first, else the most recently admitted (under
the ``priority`` policy, the one with the highest ``priority`` value first): its blocks go
back to the pool and it returns to the front of the waiting queue. Without a second KV tier it
is preempted by recompute: when readmitted, prefix caching usually finds its blocks again.
With one, the KV manager swaps its blocks out instead when moving them costs less than
recomputing them (:class:`~pagedkv.memory.TieredKVCacheManager`); such a sequence is not
readmitted before its blocks are out.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Collection

from pagedkv.engine.config import EngineSettings
from pagedkv.engine.core import adapter_admission as lora
from pagedkv.engine.core.fairness import FairShare, Holdings, admission_order, check_priority, choose_victim
from pagedkv.engine.core.headroom import Headroom, Projection, Refusal
from pagedkv.engine.core.kv_policy import PAGED, KVPolicy
from pagedkv.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput  # the step's record
from pagedkv.engine.core.sequence import Sequence, SequenceStatus
from pagedkv.engine.spec.scheduling import add_spec_tokens
from pagedkv.memory import KVCacheManager

logger = logging.getLogger("pagedkv.scheduler")


class Scheduler:
    """Continuous batching over one KV pool (see the module docstring).

    It owns the waiting and running queues. Before the forward pass :meth:`schedule` admits,
    grows and preempts; after it the commit point (:mod:`pagedkv.engine.core.commit`) forks, frees,
    rolls back and caches. They are the only callers of the :class:`~pagedkv.memory.KVCacheManager`,
    so the queues and the block tables never disagree.
    """

    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_policy: KVPolicy = PAGED,
        max_model_len: int = 2048,
        decode_headroom: float = 1.0,
        scheduling_policy: str = "fcfs",
        max_running_share: float = 0.5,
        priority_range: tuple[int, int] = (-100, 100),
        adapters: lora.AdapterResidency | None = None,
        paged_adapters: lora.PagedAdapters | None = None,
    ) -> None:
        self.scheduling_policy = scheduling_policy
        self.by_priority = scheduling_policy == "priority"
        #: The ``priority`` values a request may carry: (min, max), 0 included (``SchedulerConfig``'s check).
        self.priority_range = priority_range
        self.share = FairShare(
            max_running_share,
            max_num_seqs,
            kv_manager.num_blocks,
            kv_manager.block_size,
            kv_policy,
            max_model_len,
        )
        #: Waiting sequences per client request: whether others wait (fairness's rule 2).
        self._waiting_clients: Counter[str] = Counter()
        #: The running set's growth, built at most once a step (and again after a preemption).
        self._projection: Projection | None = None
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
        #: the verdict stands for a while (:class:`~pagedkv.engine.core.headroom.Refusal`), and the
        #: steps in between skip projecting the running set.
        self._refusal: Refusal | None = None
        #: This step's admission stopped at a waiting request whose blocks did not fit, with
        #: room left in the batch: the KV pool, not the batch size, kept it waiting.
        self.admission_blocked_by_kv = False
        #: LoRA adapters' slots and pages (None: off; ``adapter_admission``, ``adapter_paging``).
        self.adapters = adapters
        self.paged_adapters = paged_adapters
        if decode_headroom and kv_policy.grows_on_demand:
            self.headroom = Headroom(kv_manager, decode_headroom, max_num_batched_tokens, max_model_len)

    @classmethod
    def from_config(
        cls, settings: EngineSettings, kv_manager: KVCacheManager, max_model_len: int
    ) -> Scheduler:
        """The scheduler an engine of ``settings`` runs (its options checked by ``SchedulerConfig``)."""
        config = settings.scheduler
        return cls(
            kv_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            settings.kv_policy,
            max_model_len,
            config.decode_headroom,
            config.scheduling_policy,
            config.max_running_share,
            config.priority_range,
            *lora.adapter_parts(settings.lora, kv_manager),
        )

    # -- queue management -------------------------------------------------------------------
    def check_priority(self, priority: object) -> None:
        """Raise :class:`~pagedkv.engine.validation.InvalidRequestError` unless this policy takes
        ``priority`` (a non-zero one needs the ``priority`` policy, and any is bounded by
        :attr:`priority_range`)."""
        check_priority(self.scheduling_policy, priority, *self.priority_range)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        self._waiting_clients[seq.request.client] += 1

    def _dequeue(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        client = seq.request.client
        self._waiting_clients[client] -= 1
        if not self._waiting_clients[client]:
            del self._waiting_clients[client]

    def _others_wait(self, client: str) -> bool:
        """A client request other than ``client`` has a sequence waiting."""
        waiting = self._waiting_clients
        return len(waiting) > 1 or (bool(waiting) and client not in waiting)

    def reserve_tokens(self, seq: Sequence) -> int:
        """Slots to hold for ``seq`` at admission, beyond its current tokens."""
        max_tokens = seq.request.params.max_tokens
        return self.kv_policy.reserved_tokens(seq.prompt_len, max_tokens, self.max_model_len)

    def run(self, seq: Sequence) -> None:
        """``seq`` joins the running set (admitted, or forked from a running sequence)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq``, finished, out of its queue (:func:`~pagedkv.engine.core.commit.finish` frees it)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self._dequeue(seq)
        seq.status = SequenceStatus.FINISHED

    def blocks_returned(self) -> None:
        """Blocks came back to the pool: the waiting head admission refused may fit now."""
        self._refusal = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_to_admit(self, seq: Sequence) -> int:
        use_cache = not seq.needs_prompt_logits  # a cached token has no logits to score it
        salt, reserve = seq.request.prefix_salt, self.reserve_tokens(seq)
        blocks = self.kv_manager.blocks_to_allocate(seq.token_ids, reserve, use_cache, salt)
        return blocks + lora.page_blocks(self, seq)  # its adapter's pages count beside them

    def _shortfall(
        self, seq: Sequence, needed: int, budget: int, out: SchedulerOutput, unprotected: Collection[str]
    ) -> int:
        """Blocks missing for ``seq``'s ``needed`` blocks to fit, and (with headroom) the running
        requests' growth with them, but for the ``unprotected`` client requests' (<= 0: it fits).
        With nothing running the prompt alone decides, so a request always makes progress. The
        running set's projection is only built when the prompt fits."""
        shortfall = needed - self.kv_manager.allocatable_blocks
        if shortfall > 0 or self.headroom is None or not self.running:
            return shortfall
        if self._projection is None:  # a Growth per running sequence
            scheduled = {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}
            self._projection = self.headroom.projection(self.running, scheduled)
        return self._projection.shortfall(seq, needed, budget, unprotected)

    def _kv_shortfall(
        self, seq: Sequence, budget: int, out: SchedulerOutput, unprotected: Collection[str]
    ) -> int:
        """:meth:`_shortfall`, answered by a standing refusal where one stands (only when no
        request over its share could give blocks back); records a new refusal."""
        needed = self._blocks_to_admit(seq)
        refusal = self._refusal
        if not unprotected and refusal is not None and refusal.stands(seq, budget, needed):
            return refusal.shortfall
        shortfall = self._shortfall(seq, needed, budget, out, unprotected)
        if shortfall <= 0 or unprotected:
            self._refusal = None
        else:
            self._refusal = Refusal.of(seq, budget, needed, shortfall, self.headroom is not None)
        return shortfall

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
        if self.adapters is not None:
            lora.record_adapters(out, self.adapters, self.paged_adapters)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Decodes first (they are cheap and keep inter-token latency steady), then the tokens
        they proposed (:func:`~pagedkv.engine.spec.scheduling.add_spec_tokens`), then unfinished
        prompt chunks; returns the token budget left."""
        budget = self.max_num_batched_tokens
        running = sorted(self.running, key=lambda s: s.in_prefill)
        num_decodes = sum(not s.in_prefill for s in running)
        for i, seq in enumerate(running):
            if i == num_decodes:
                budget = add_spec_tokens(out, self.kv_manager, budget)
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted while making room for an earlier one
            if seq.num_computed_tokens == seq.num_tokens:
                continue  # a beam waiting for its siblings: nothing to compute
            preempted = len(out.preempted)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget) if seq.in_prefill else 1
            copies = self._make_room(seq, out, seq.num_computed_tokens + n if seq.in_prefill else None)
            if len(out.preempted) != preempted:
                budget = self.max_num_batched_tokens - out.num_tokens  # victims gave theirs back
            if copies is None:
                continue
            out.block_copies.extend(copies)
            out.scheduled.append(ScheduledSeq.next_chunk(seq, n))
            budget -= n
        return add_spec_tokens(out, self.kv_manager, budget) if num_decodes == len(running) else budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in fair order (:mod:`pagedkv.engine.core.fairness`) while the
        budgets and the KV pool allow; a sequence over its request's share while others wait is
        passed over, one that does not fit stops admission (it is next)."""
        self.admission_blocked_by_kv = False
        self._projection = None
        if self._refusal is not None:
            self._refusal.steps += 1
        if not self.waiting:
            return
        holdings = self.share.holdings(self.running)
        admitted: set[int] = set()  # ids admitted this step: spared by this step's reclaims
        passed_over: set[str] = set()  # client requests at their share: the rest of theirs waits
        adapter_gate = lora.AdapterGate(self.adapters, self.running)  # FCFS among adapters' sequences
        for seq in admission_order(self.waiting, holdings, self.by_priority, self._waiting_clients):
            client = seq.request.client
            if budget <= 0:
                break
            if client in passed_over or not self.kv_manager.swap_ready(seq.seq_id):
                continue  # at its share; or its blocks are still being swapped out
            if adapter_gate.waits(seq):
                continue  # its adapter (or an earlier one) finds no slot: base sequences go first
            if self._others_wait(client) and not holdings.may_start(seq):
                passed_over.add(client)  # at its share while others wait
                continue
            preempted = len(out.preempted)
            if not self._room_for(seq, out, budget, holdings, admitted):
                break
            if len(out.preempted) != preempted:
                budget = self.max_num_batched_tokens - out.num_tokens  # victims gave theirs back
            budget -= self._admit(seq, out, budget, holdings)
            admitted.add(seq.seq_id)

    def _room_for(
        self, seq: Sequence, out: SchedulerOutput, budget: int, holdings: Holdings, admitted: set[int]
    ) -> bool:
        """Whether ``seq`` fits now -- a running slot, and its blocks with headroom -- after
        taking back what it needs from client requests over their share (fairness's rule 3)."""
        unprotected = holdings.unprotected(seq)
        while True:
            has_slot = len(self.running) < self.max_num_seqs
            if has_slot and self._kv_shortfall(seq, budget, out, unprotected) <= 0:
                return True
            victim = None
            if unprotected:
                victim = choose_victim(self.running, holdings, self.by_priority, unprotected, admitted)
            if victim is None:
                self.admission_blocked_by_kv = has_slot
                return False
            self._preempt(victim, out)
            holdings.release(victim)
            budget = self.max_num_batched_tokens - out.num_tokens
            unprotected = holdings.unprotected(seq)

    def _admit(self, seq: Sequence, out: SchedulerOutput, budget: int, holdings: Holdings) -> int:
        """Allocate ``seq``'s blocks and schedule its first chunk; returns the chunk's tokens."""
        self._dequeue(seq)
        lookup = (self.reserve_tokens(seq), not seq.needs_prompt_logits, seq.request.prefix_salt)
        cached = lora.allocate_with_adapter(self, seq, *lookup)  # its adapter placed and pinned too
        seq.num_computed_tokens = cached
        if seq.num_output_tokens == 0:
            seq.request.num_cached_tokens = cached
        self.run(seq)
        holdings.take(seq)
        n = min(seq.num_tokens - cached, budget)
        out.scheduled.append(ScheduledSeq.next_chunk(seq, n))
        if self._projection is not None:
            self._projection.add(seq, n)
        return n

    def _make_room(
        self, seq: Sequence, out: SchedulerOutput, chunk_end: int | None = None
    ) -> list[tuple[int, int]] | None:
        """Grow ``seq`` by one token, or hold the blocks of its prompt chunk up to ``chunk_end``
        (:meth:`KVCacheManager.try_hold`), preempting running sequences (:meth:`_victim`) until
        it fits. Returns its copy-on-write block copies, or None if ``seq`` itself had to be
        preempted."""
        kv, start = self.kv_manager, seq.num_computed_tokens
        while (
            copies := kv.try_append(seq.seq_id, 1)
            if chunk_end is None
            else ([] if kv.try_hold(seq.seq_id, start, chunk_end) else None)
        ) is None:
            victim = self._victim()
            self._preempt(victim, out)
            if victim is seq:
                return None
        return copies

    def _victim(self) -> Sequence:
        """The running sequence to preempt when the pool runs dry: the newest, unless the
        priority policy or a request over its share says otherwise (see ``fairness``)."""
        if not (self.share.enabled or self.by_priority):
            return self.running[-1]
        victim = choose_victim(self.running, self.share.holdings(self.running), self.by_priority)
        assert victim is not None  # a sequence needs room, so one runs
        return victim

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take ``seq``'s blocks back and requeue it at the front: by swap (a second tier keeps
        its computed tokens; never for prompt logprobs, which must be computed) or by
        recompute, as the KV manager chooses."""
        self._refusal = None  # its blocks come back, and it heads the queue
        self._projection = None  # it projected the running set this sequence has just left
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        # Never the last token: readmission computes it, and its logits with it.
        kept = min(seq.num_computed_tokens, seq.num_tokens - 1)
        outcome = self.kv_manager.preempt(seq.seq_id, seq.token_ids, kept, not seq.needs_prompt_logits)
        lora.release_adapter(self, seq)
        lost = seq.num_computed_tokens - outcome.tokens_kept
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=True)
        out.preempted.append(seq)
        out.dropped_tokens += lost
        out.swapped_preemptions += outcome.swapped
        # The first preemption is worth a warning (the pool is too small for the load); every
        # one is logged, at INFO after that, so a busy server does not flood its stderr.
        log = logger.info if self._preempted_before else logger.warning
        self._preempted_before = True
        log(
            "preempted request %s (sample %d) by %s: %d computed tokens dropped, %d KV blocks free of %d",
            seq.request.request_id,
            seq.index,
            "swap" if outcome.swapped else "recompute",
            lost,
            self.kv_manager.usage().free_blocks,
            self.kv_manager.num_blocks,
        )
