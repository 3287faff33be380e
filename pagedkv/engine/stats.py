"""What the engine publishes about itself, as plain records: read them, never its internals.

* :class:`StepStats` -- one record per step (``LLMEngine.last_step``): what was scheduled, what
  preemption threw away, what the prefix cache served, the KV pool while the forward pass ran
  and after the step, the queues, the wall time.
* :class:`EngineStats` -- the engine now (``LLMEngine.stats()``): counters since it started plus
  the pool and the queues at this moment; ``kv_stats()`` is its ``LLM.kv_stats`` dictionary.
* :class:`~pagedkv.engine.kv_snapshot.KVSnapshot` -- the block map (``LLMEngine.kv_snapshot()``),
  its records in :mod:`pagedkv.engine.kv_snapshot`.

``LLM.kv_stats()``, the server's ``/metrics``, ``live_demo`` and every benchmark read these;
they are built from the scheduler's and the KV manager's counters by
:class:`StatsCollector`, the one place that looks inside.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from pagedkv.engine.kv_snapshot import KVSnapshot, SequenceBlocks
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.memory import KVUsage

if TYPE_CHECKING:
    from pagedkv.engine.core.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True)
class StepStats:
    """One engine step. Counts are of this step; KV and queue figures are after it, except the
    ``*_at_forward`` ones, taken when the step's blocks were all allocated and none yet freed."""

    #: 1 for the engine's first step.
    step: int
    scheduled_seqs: int
    #: Prompt tokens computed (a recomputation after preemption included).
    prefill_tokens: int
    #: The other computed tokens: generated tokens fed back (decodes, recomputed outputs).
    decode_tokens: int
    #: Prompt tokens of the requests whose prompt finished computing this step.
    prompt_tokens: int
    #: Tokens appended to sequences (samples and beams).
    generated_tokens: int
    finished_requests: int
    preemptions: int
    #: Computed tokens preemption threw away (they are computed again).
    dropped_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_blocks_total: int
    kv_blocks_at_forward: int
    #: Blocks the live tables referenced at the forward pass, a shared block once per holder.
    kv_table_blocks_at_forward: int
    kv_blocks_used: int
    kv_blocks_free: int
    #: Blocks whose contents the prefix cache holds (in use or not).
    kv_blocks_cached: int
    #: Blocks the live tables reference, a shared block once per holder (what the same
    #: sequences would hold without sharing), and the tokens they hold, counted the same way.
    kv_table_blocks: int
    kv_tokens_stored: int
    block_size: int
    running: int
    waiting: int
    #: This step's admission stopped at a request that did not fit in the free KV blocks
    #: although the batch had room (decided when the step was scheduled).
    admission_blocked_by_kv: bool
    step_time_s: float
    #: Of ``preemptions``, those by swap (their computed tokens wait in the second KV tier);
    #: the others recompute.
    swapped_preemptions: int = 0
    #: The second KV tier (all 0 without one): prompt tokens loaded from it at this step's
    #: admissions instead of computed, blocks moved out of the pool and into it, their bytes
    #: (all ranks), and its blocks held (hashed and swapped) after the step, of its total.
    tier_hit_tokens: int = 0
    tier_blocks_out: int = 0
    tier_blocks_in: int = 0
    tier_bytes_moved: int = 0
    tier_blocks_used: int = 0
    tier_blocks_total: int = 0
    #: Unified LoRA paging (all 0 without it): adapters loaded into pages of the pool at this
    #: step (their weights written before its forward pass) and evicted from them since the last
    #: step; after the step, the resident adapters and their pages, of which those pinned by
    #: running sequences (counted in ``kv_blocks_used``; the idle ones count as free).
    lora_page_loads: int = 0
    lora_page_evictions: int = 0
    #: With a second KV tier, where this step's loads come from: adapters copied back from the
    #: tier and adapters read from their folders (together ``lora_page_loads``); adapters whose
    #: tier copy failed its check at this step (read from the folder instead); pages of evicted
    #: adapters planned into the tier at this step.
    lora_page_tier_loads: int = 0
    lora_page_file_reads: int = 0
    lora_page_tier_fallbacks: int = 0
    lora_page_spills: int = 0
    lora_adapters_resident: int = 0
    lora_pages_resident: int = 0
    lora_pages_pinned: int = 0
    #: The drafts this step verified (vLLM's ``SpecDecodingStats``); None when none was.
    spec_decoding: SpecDecodingStats | None = None

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def kv_utilization(self) -> float:
        """Token slots holding a token / slots in the live tables: 1 - internal fragmentation
        (only each table's partly filled last block wastes slots). 1.0 when no table is live."""
        slots = self.kv_table_blocks * self.block_size
        return self.kv_tokens_stored / slots if slots else 1.0


@dataclass(frozen=True)
class TierStats:
    """The second tier now: its blocks, and counters since the engine started (tokens looked
    up in and loaded from it, blocks and bytes moved each way, the steps' time moving them)."""

    medium: str
    capacity_blocks: int
    cached_blocks: int
    swap_blocks: int
    query_tokens: int
    hit_tokens: int
    blocks_stored: int
    blocks_loaded: int
    bytes_out: int
    bytes_in: int
    seconds_out: float
    seconds_in: float
    evictions: int
    load_failures: int

    @property
    def usage(self) -> float:
        """Held slots / capacity (vLLM's ``kv_offload_cpu_cache_usage_perc``)."""
        return (self.cached_blocks + self.swap_blocks) / self.capacity_blocks

    def kv_stats(self) -> dict[str, Any]:
        """The keys ``LLM.kv_stats()`` adds for the tier."""
        return {
            "tier_medium": self.medium,
            "tier_blocks_total": self.capacity_blocks,
            "tier_blocks_cached": self.cached_blocks,
            "tier_blocks_swap": self.swap_blocks,
            "tier_usage": self.usage,
            "tier_queries_tokens": self.query_tokens,
            "tier_hits_tokens": self.hit_tokens,
            "tier_blocks_stored": self.blocks_stored,
            "tier_blocks_loaded": self.blocks_loaded,
            "tier_bytes_out": self.bytes_out,
            "tier_bytes_in": self.bytes_in,
            "tier_seconds_out": self.seconds_out,
            "tier_seconds_in": self.seconds_in,
            "tier_evictions": self.evictions,
            "tier_load_failures": self.load_failures,
        }


@dataclass(frozen=True)
class TierStep:
    """One step's second-tier figures (``StepStats.tier_*``): prompt tokens loaded at its
    admissions, blocks moved out of the pool and into it, their bytes, and the tier's blocks
    held (hashed and swapped) after the step, of its total."""

    hit_tokens: int = 0
    blocks_out: int = 0
    blocks_in: int = 0
    bytes_moved: int = 0
    blocks_used: int = 0
    blocks_total: int = 0


class TierReporter(Protocol):
    """What the statistics read of a second KV tier (``engine/kv_tier.KVTierLink``; None
    without one), and the link's view of each step (the swap cost model's prefill rate)."""

    def step_record(self) -> TierStep | None: ...

    def stats(self) -> TierStats | None: ...

    def observe(self, step: StepStats) -> None: ...


@dataclass(frozen=True)
class EngineStats:
    """The engine now: counters since it started, the KV pool and the queues."""

    steps: int
    kv: KVUsage
    #: Sequences holding a block table (0 once every block is back).
    kv_sequences: int
    running: int
    waiting: int
    preemptions: int
    dropped_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generated_tokens: int
    #: Of ``preemptions``, those by swap.
    swapped_preemptions: int = 0
    #: The second KV tier (None: no tier).
    tier: TierStats | None = None
    #: Every draft verified since the engine started; None for an engine that does not speculate.
    spec_decoding: SpecDecodingStats | None = None

    def kv_stats(self) -> dict[str, float | int | str]:
        """Blocks total / used / free / cached, utilization, preemptions (by swap and by
        recompute), prefix-cache tokens, queues, and the second tier's figures when there is
        one: the dictionary ``LLM.kv_stats()`` returns."""
        queries, hits = self.prefix_cache_queries, self.prefix_cache_hits
        tier = {} if self.tier is None else self.tier.kv_stats()
        return tier | {
            "block_size": self.kv.block_size,
            "blocks_total": self.kv.total_blocks,
            "blocks_used": self.kv.used_blocks,
            "blocks_free": self.kv.free_blocks,
            "blocks_cached": self.kv.cached_blocks,
            "utilization": self.kv.utilization,
            "preemptions": self.preemptions,
            "preemptions_swapped": self.swapped_preemptions,
            "preemptions_recomputed": self.preemptions - self.swapped_preemptions,
            "prefix_cache_queries_tokens": queries,
            "prefix_cache_hits_tokens": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "running": self.running,
            "waiting": self.waiting,
        }


#: The counts of a step that :class:`EngineStats` sums over every step.
SUMMED = ("preemptions", "swapped_preemptions", "dropped_tokens", "prompt_tokens", "generated_tokens")


class StatsCollector:
    """Builds the records above from the scheduler, its KV manager and the second KV tier's
    link (whose records are None without a tier), which sees each step too; keeps the totals."""

    def __init__(
        self, scheduler: Scheduler, kv_tier: TierReporter | None = None, speculating: bool = False
    ) -> None:
        self.scheduler = scheduler
        self.kv_tier = kv_tier
        self.last_step: StepStats | None = None
        self.totals = dict.fromkeys(("steps", *SUMMED), 0)
        #: The drafts of every step so far (None when the engine does not speculate).
        self.spec_totals = SpecDecodingStats() if speculating else None

    def record_step(
        self,
        out: SchedulerOutput,
        prompt_tokens: int,
        generated: int,
        finished: int,
        seconds: float,
        spec_decoding: SpecDecodingStats | None = None,
    ) -> StepStats:
        scheduler, kv_manager = self.scheduler, self.scheduler.kv_manager
        prefill = sum(max(0, min(i.end, i.seq.prompt_len) - i.start) for i in out.scheduled)
        usage = kv_manager.usage()
        step = StepStats(
            step=self.totals["steps"] + 1,
            scheduled_seqs=len(out.scheduled),
            prefill_tokens=prefill,
            decode_tokens=out.num_tokens - prefill,
            prompt_tokens=prompt_tokens,
            generated_tokens=generated,
            finished_requests=finished,
            preemptions=len(out.preempted),
            dropped_tokens=out.dropped_tokens,
            prefix_cache_queries=out.prefix_cache_queries,
            prefix_cache_hits=out.prefix_cache_hits,
            kv_blocks_total=usage.total_blocks,
            kv_blocks_at_forward=out.kv_blocks_used,
            kv_table_blocks_at_forward=out.kv_table_blocks,
            kv_blocks_used=usage.used_blocks,
            kv_blocks_free=usage.free_blocks,
            kv_blocks_cached=usage.cached_blocks,
            kv_table_blocks=kv_manager.num_table_blocks(),
            kv_tokens_stored=kv_manager.num_stored_tokens(),
            block_size=usage.block_size,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            admission_blocked_by_kv=scheduler.admission_blocked_by_kv,
            step_time_s=seconds,
            swapped_preemptions=out.swapped_preemptions,
            **self._tier_step(),
            **({} if scheduler.paged_adapters is None else scheduler.paged_adapters.step_stats(out)),
            spec_decoding=spec_decoding,
        )
        if spec_decoding is not None and self.spec_totals is not None:
            self.spec_totals.merge(spec_decoding)
        self.totals["steps"] = step.step
        for name in SUMMED:
            self.totals[name] += getattr(step, name)
        self.last_step = step
        if self.kv_tier is not None:
            self.kv_tier.observe(step)
        return step

    def _tier_step(self) -> dict[str, int]:
        record = None if self.kv_tier is None else self.kv_tier.step_record()
        return {} if record is None else {f"tier_{name}": value for name, value in asdict(record).items()}

    def engine_stats(self) -> EngineStats:
        kv_manager, queues = self.scheduler.kv_manager, self.scheduler
        prefix = {
            "prefix_cache_queries": kv_manager.prefix_query_tokens,
            "prefix_cache_hits": kv_manager.prefix_hit_tokens,
        }
        return EngineStats(
            kv=kv_manager.usage(),
            kv_sequences=kv_manager.num_seqs,
            running=len(queues.running),
            waiting=len(queues.waiting),
            **prefix,
            **self.totals,
            tier=None if self.kv_tier is None else self.kv_tier.stats(),
            spec_decoding=self._spec_totals_copy(),
        )

    def _spec_totals_copy(self) -> SpecDecodingStats | None:
        """The drafts so far, as a copy the next steps leave alone."""
        totals = self.spec_totals
        if totals is None:
            return None
        return replace(totals, num_accepted_tokens_per_pos=list(totals.num_accepted_tokens_per_pos))

    def kv_snapshot(self) -> KVSnapshot:
        kv, paged = self.scheduler.kv_manager, self.scheduler.paged_adapters
        pool = kv.snapshot()
        sequences = []
        for seq in self.scheduler.running:
            table, request = pool.tables.get(seq.seq_id), seq.request
            if table is not None:
                prompt = (len(request.prompt_token_ids), request.num_cached_tokens)
                blocks = (table.block_ids, table.num_tokens)
                sequences.append(
                    SequenceBlocks(request.request_id, seq.index, *blocks, *prompt, table.groups)
                )
        adapters = () if paged is None else paged.snapshot()
        windows = kv.group_windows
        return KVSnapshot(
            pool.block_size, pool.refcounts, pool.cached, sequences, adapters, windows, kv.null_block
        )
