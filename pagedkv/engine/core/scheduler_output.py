"""What the scheduler decided for one step: the token slices to compute, and what it cost.

Plain records the engine reads after :meth:`~pagedkv.engine.core.scheduler.Scheduler.schedule`: it
turns them into the executor's :class:`~pagedkv.engine.core.plan.StepPlan`, samples the
slices that need logits and publishes the step's statistics from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.core.plan import SeqSlice, ShippedTables, StepPlan
from pagedkv.engine.core.sequence import Sequence
from pagedkv.memory import KVCacheManager
from pagedkv.memory.adapters import PageWrite, SlotLoad


@dataclass(frozen=True)
class ScheduledSeq:
    """A sequence and the slice ``start:end`` of its tokens this step computes.

    Fixed when scheduled: the sequence itself moves on after the step. A speculating decode's
    slice ends with its proposed tokens: positions ``end - num_spec_tokens .. end - 1`` hold
    ``spec_token_ids``, which are not (yet) the sequence's tokens.
    """

    seq: Sequence
    start: int
    end: int
    #: The slice reaches the sequence's last token, so its logits are sampled.
    needs_logits: bool
    #: The proposed tokens this step verifies after the sequence's last token.
    spec_token_ids: tuple[int, ...] = ()

    @classmethod
    def next_chunk(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        return cls(seq, start, end, end == seq.num_tokens and seq.finish_reason is None)

    def with_spec_tokens(self, spec_token_ids: tuple[int, ...]) -> ScheduledSeq:
        """This decode, followed by ``spec_token_ids`` to verify in the same pass."""
        return ScheduledSeq(self.seq, self.start, self.end + len(spec_token_ids), True, spec_token_ids)

    @property
    def num_new_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_spec_tokens(self) -> int:
        return len(self.spec_token_ids)


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
    #: Preemptions by swap (their computed tokens wait in the second tier); the others recompute.
    swapped_preemptions: int = 0
    #: Prompt tokens looked up in, and served by, the prefix cache at this step's admissions.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: Blocks held once the step's slots and copies are allocated: what its forward pass needs.
    kv_blocks_used: int = 0
    #: Blocks the live block tables reference then, a shared block once per holder (what the
    #: same sequences would hold without sharing).
    kv_table_blocks: int = 0
    #: LoRA adapters placed into slots at this step's admissions, and every resident adapter's
    #: slot (adapter id -> slot) once they are placed.
    lora_loads: list[SlotLoad] = field(default_factory=list)
    lora_slots: dict[int, int] = field(default_factory=dict)
    #: With unified paging: the adapters loaded into pages of the KV block pool at this step's
    #: admissions (their weights to write), and the adapters evicted from their pages since the
    #: last step.
    lora_page_writes: list[PageWrite] = field(default_factory=list)
    lora_evicted: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def plan(self, kv_manager: KVCacheManager, tables: ShippedTables) -> StepPlan:
        """The executor's record of this step: token slices, the block-table edits since the
        plans ``tables`` made before, the block copies and the second tier's moves, as plain
        data."""
        slices = [
            SeqSlice(
                seq_id=item.seq.seq_id,
                token_ids=item.seq.token_ids[item.start : item.end - item.num_spec_tokens]
                + list(item.spec_token_ids),
                start=item.start,
                needs_logits=item.needs_logits,
                prompt_logits=item.seq.needs_prompt_logits,
                prompt_len=item.seq.prompt_len,
                num_spec_tokens=item.num_spec_tokens,
                lora_slot=self._lora_slot(item.seq),
            )
            for item in self.scheduled
        ]
        transfers = kv_manager.take_transfers()
        return tables.plan(
            slices, kv_manager, list(self.block_copies), transfers, self.lora_loads, self.lora_page_writes
        )

    def _lora_slot(self, seq: Sequence) -> int:
        lora_id = seq.request.lora_int_id
        return -1 if lora_id is None else self.lora_slots[lora_id]
