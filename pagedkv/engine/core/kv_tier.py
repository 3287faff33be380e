"""The engine's side of a second KV tier (``kv_offload``): the pool's blocks are not lost.

With ``kv_offload="host"`` (RAM) or ``"disk"`` (one file per block in ``kv_offload_dir``) the
engine's KV manager is a :class:`~pagedkv.memory.TieredKVCacheManager`: a cached block the pool
evicts is spilled to the tier, a prompt whose prefix misses the pool but hits the tier loads
those blocks back instead of recomputing them, and a preempted request is swapped out when its
blocks cost less to move than to recompute. The manager decides; each step's moves travel in
the :class:`~pagedkv.engine.core.plan.StepPlan` and every rank's executor performs them on its
shard (``engine/worker/executor/tier_io.py``). :class:`KVTierLink` closes the loop after each step:
it acknowledges what the executor finished, takes a sequence whose load failed its check out of
the step (it never samples from such a step) and names the tokens it still holds (the commit
point sets its progress back to them, so it recomputes the rest), updates the swap cost model from the
measured rates, hands the tier's changes to the KV-event listener and counts bytes and time
by vLLM's transfer types.

Warm restart: a disk tier's files outlive the process. At start-up the executor scans the
folder (files of another model, dtype, block size or layout, and torn ones, are skipped, counted
by reason in one warning); the newest ``capacity`` blocks are indexed again and the rest deleted. At shutdown
the pool's cached blocks are written out too, so the next engine finds the whole prefix cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from pagedkv.engine.config import EngineSettings
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.stats import StepStats, TierStats, TierStep
from pagedkv.log_limits import ThrottledLog
from pagedkv.memory import KVCacheManager, KVTier, KVTransfers, SwapCostModel, TieredKVCacheManager
from pagedkv.memory.hybrid_manager import HybridKVCacheManager

if TYPE_CHECKING:
    from pagedkv.engine.core.scheduler_output import SchedulerOutput
    from pagedkv.engine.core.sequence import Sequence
    from pagedkv.engine.worker.executor.base import Executor, TierSpec

logger = logging.getLogger("pagedkv.engine.core.kv_tier")

#: Weight of a new measurement in the cost model's running rates.
RATE_SMOOTHING = 0.2
#: Steps that compute fewer tokens say more about fixed costs than about the prefill rate.
MIN_RATE_TOKENS = 16


def make_kv_manager(
    settings: EngineSettings, executor: Executor
) -> tuple[KVCacheManager, KVTierLink | NoKVTier]:
    """The engine's KV manager over the executor's pool, tiered when the executor holds a tier
    (whose blocks a restarted disk tier indexes again at once), and its link to the tier."""
    num_blocks, spec = executor.num_kv_blocks, executor.tier
    config, caching = settings.cache, settings.prefix_caching
    if spec is None and executor.kv_groups is not None:
        groups = executor.kv_groups
        chunk = settings.scheduler.max_num_batched_tokens
        return HybridKVCacheManager(
            num_blocks, groups, config.block_size, caching, config.watermark, chunk
        ), NoKVTier()
    if spec is None:
        return KVCacheManager(num_blocks, config.block_size, caching, config.watermark), NoKVTier()
    tier = KVTier(spec.capacity, spec.medium)
    manager = TieredKVCacheManager(
        num_blocks,
        config.block_size,
        tier,
        spec.block_bytes,
        caching,
        config.watermark,
        SwapCostModel(),
        settings.tier.preemption_mode,
    )
    link = KVTierLink(manager, executor, spec)
    link.restore()
    return manager, link


class NoKVTier:
    """The link of an engine without a second tier: nothing moves, so every hook is empty."""

    def settle_moves(self) -> dict[Any, int]:
        return {}

    def poll(self) -> bool:
        return False

    def settle(
        self, scheduled: SchedulerOutput, plan: StepPlan, logits: Any
    ) -> tuple[StepPlan, Any, dict[Sequence, int]]:
        return plan, logits, {}

    def flush(self) -> None:
        pass

    def observe(self, step: StepStats) -> None:
        pass

    def step_record(self) -> None:
        return None

    def stats(self) -> None:
        return None


class KVTierLink:
    """After each step: acknowledgements, load failures, rates, events, counters (module doc)."""

    def __init__(self, kv_manager: TieredKVCacheManager, executor: Executor, spec: TierSpec) -> None:
        self.kv_manager = kv_manager
        self.executor = executor
        self.spec = spec
        self.bytes_out = self.bytes_in = 0
        self.seconds_out = self.seconds_in = 0.0
        self.load_failures = 0
        #: the last step's (tier hit tokens, blocks out, blocks in, bytes moved)
        self._moved = (0, 0, 0, 0)
        self._hit_tokens = 0
        #: a tier whose files keep failing their checks fails a load every step: one line a while
        self._log = ThrottledLog(logger, "KV tier")

    # -- start and end ----------------------------------------------------------------------
    def restore(self) -> None:
        """Index the blocks the executor's tier found (a disk tier's files, oldest first): the
        newest that fit; the files of the others are deleted."""
        found = self.executor.tier_blocks_found()
        if not found:
            return
        indexed = self.kv_manager.restore(found[-self.spec.capacity :])
        stale = [digest for digest, _, _ in found if digest not in indexed]
        if stale:
            self.executor.discard_tier_blocks(stale)
        logger.info(
            "KV tier: %d blocks found in %s, %d indexed, %d deleted",
            len(found),
            self.spec.folder,
            len(indexed),
            len(stale),
        )

    def flush(self) -> None:
        """Write the pool's cached blocks to a disk tier and wait for the files (shutdown): a
        restarted engine finds them. A host tier ends with the process, and an executor already
        shut down holds nothing to write: nothing to do."""
        self._log.flush()
        if self.spec.kind != "disk" or self.executor.runner is None:
            return
        self.kv_manager.spill_cached()
        self._run_moves(self.kv_manager.take_transfers())
        self.executor.drain_tier()
        self.settle_moves()

    # -- each step --------------------------------------------------------------------------
    def settle(
        self, scheduled: SchedulerOutput, plan: StepPlan, logits: Any
    ) -> tuple[StepPlan, Any, dict[Sequence, int]]:
        """Account for the step the executor just ran; a sequence one of whose loads failed its
        check leaves the step (its slice and logits rows dropped) and recomputes the rest from
        its next step. Returns the plan and logits left, and the computed tokens still valid of
        each sequence that left (the commit point sets them)."""
        failures = self.settle_moves(plan.kv_transfers)
        if not failures:
            return plan, logits, {}
        return drop_from_step(scheduled, plan, logits, failures)

    def settle_moves(self, transfers: KVTransfers | None = None) -> dict[Any, int]:
        """Acknowledge what the executor finished since the last call (``transfers``: the moves
        of the step it just ran); returns the load failures, by sequence (see
        :meth:`~pagedkv.memory.TieredKVCacheManager.take_load_failures`)."""
        report = self.executor.tier_report()
        blocks_out = transfers.num_outbound if transfers is not None else 0
        blocks_in = transfers.num_inbound if transfers is not None else 0
        moved = (blocks_out + blocks_in) * self.spec.block_bytes
        self.bytes_out += blocks_out * self.spec.block_bytes
        self.bytes_in += blocks_in * self.spec.block_bytes
        self.seconds_out += report.seconds_out
        self.seconds_in += report.seconds_in
        seconds = report.seconds_out + report.seconds_in
        if moved and seconds > 0:
            model = self.kv_manager.cost_model
            model.copy_bytes_per_s = _smooth(model.copy_bytes_per_s, moved / seconds)
        self.kv_manager.complete(report)
        hits = self.kv_manager.tier_hit_tokens
        self._moved = (hits - self._hit_tokens, blocks_out, blocks_in, moved)
        self._hit_tokens = hits
        self._publish_events()
        failures = self.kv_manager.take_load_failures()
        if failures:
            self.load_failures += len(failures)
            self._log.warning(
                "load",
                "steps with failed loads",
                "loads of %d sequences failed their check; they recompute (%d in all)",
                len(failures),
                self.load_failures,
            )
        return failures

    def poll(self) -> bool:
        """With nothing to schedule: run the moves still planned and acknowledge the writes that
        ended (a swapped-out sequence waits for them). False when nothing is in flight."""
        transfers = self.kv_manager.take_transfers()
        if transfers.is_empty and not self.kv_manager.transfers_in_flight():
            return False
        self._run_moves(transfers)
        if self.kv_manager.transfers_in_flight():
            time.sleep(0.001)  # a disk tier's writer threads: let them finish a file
        return True

    def observe(self, step: StepStats) -> None:
        """Learn the model's prefill rate from a step that computed enough prompt tokens."""
        if step.prefill_tokens >= MIN_RATE_TOKENS and step.step_time_s > 0:
            model = self.kv_manager.cost_model
            rate = step.num_tokens / step.step_time_s
            model.prefill_tokens_per_s = _smooth(model.prefill_tokens_per_s, rate)

    # -- what the engine publishes ----------------------------------------------------------
    def step_record(self) -> TierStep:
        """The last step's moves and the tier after it."""
        usage = self.kv_manager.tier_usage()
        return TierStep(*self._moved, usage.cached_blocks + usage.swap_blocks, usage.capacity_blocks)

    def stats(self) -> TierStats:
        manager, usage = self.kv_manager, self.kv_manager.tier_usage()
        return TierStats(
            medium=usage.medium,
            capacity_blocks=usage.capacity_blocks,
            cached_blocks=usage.cached_blocks,
            swap_blocks=usage.swap_blocks,
            query_tokens=manager.tier_query_tokens,
            hit_tokens=manager.tier_hit_tokens,
            blocks_stored=manager.blocks_spilled + manager.blocks_swapped_out,
            blocks_loaded=manager.blocks_loaded + manager.blocks_swapped_in,
            bytes_out=self.bytes_out,
            bytes_in=self.bytes_in,
            seconds_out=self.seconds_out,
            seconds_in=self.seconds_in,
            evictions=manager.tier.num_evictions,
            load_failures=self.load_failures,
        )

    # -- helpers ----------------------------------------------------------------------------
    def _run_moves(self, transfers: KVTransfers) -> None:
        """An executor step that only moves blocks, then its acknowledgements."""
        if not transfers.is_empty:
            self.executor.execute(StepPlan([], [], transfers))
        self.settle_moves(transfers)

    def _publish_events(self) -> None:
        """The tier's changes to the KV-event listener (taken every step either way)."""
        events = self.kv_manager.take_tier_events()
        listener = self.kv_manager.pool.listener
        if events and listener is not None:
            listener.tier_changed(events)


def _smooth(old: float, new: float) -> float:
    return (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * new


def drop_from_step(
    scheduled: SchedulerOutput, plan: StepPlan, logits: Any, failures: dict[Any, int]
) -> tuple[StepPlan, Any, dict[Sequence, int]]:
    """The step without the sequences in ``failures`` (by sequence id: the computed tokens still
    valid of each): their items, slices and logits rows dropped. Returns the plan and logits
    left, and the computed tokens each dropped sequence keeps (at most its slice's start)."""
    kept, slices, rows = [], [], []
    reverted: dict[Sequence, int] = {}
    row = 0
    for item, piece in zip(scheduled.scheduled, plan.slices, strict=True):
        count = len(piece.logits_rows())
        valid = failures.get(item.seq.seq_id)
        if valid is None:
            kept.append(item)
            slices.append(piece)
            rows.extend(range(row, row + count))
        else:
            reverted[item.seq] = min(valid, item.start)
        row += count
    scheduled.scheduled = kept
    return dataclasses.replace(plan, slices=slices), logits[rows], reverted
