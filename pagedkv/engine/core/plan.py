"""StepPlan: the one record the engine hands the executor per step, and the block-table edits in it.

Plain data only -- ints, lists of ints, booleans; no sequences, no tensors -- so that it can be
pickled or sent as JSON to worker processes (tensor parallelism broadcasts the same record to
every rank), and so that the model runner builds a step from it and the tables it keeps. Block
ids mean the same thing on every rank: each rank's KV pool holds its shard of the heads at the
same ids.

A plan does not resend every block table (vLLM's ``SchedulerOutput`` shape): each runner keeps
a copy of the tables of the sequences it computes, and the plan carries what changed since the
last plan -- a new sequence's table whole, a running one's appended blocks, a table cut back by a
copy-on-write or a rollback and continued -- plus the sequences whose tables are gone.
:class:`ShippedTables` is the driver's record of what the plans sent, from which it makes the
edits; every runner applies the same edits in the same order, so every rank's tables stay equal
to the driver's (:class:`~pagedkv.engine.worker.step_inputs.RunnerTables`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import asdict, dataclass, field

from pagedkv.memory import KVCacheManager, KVTransfers
from pagedkv.memory.adapters import PageWrite, SlotLoad

SeqId = Hashable


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: its tokens ``start .. start + len(token_ids) - 1``.

    The positions before ``start`` are already in the KV cache; the runner's block table of
    ``seq_id`` (as the plans' :class:`TableEdit` left it) covers at least ``end`` tokens.
    """

    seq_id: SeqId
    token_ids: list[int]
    start: int
    #: The slice ends at the sequence's last token, whose logits the engine samples from.
    needs_logits: bool
    #: Every row's logits are returned, not only the last: the slice computes prompt tokens
    #: whose prompt logprobs were asked for (each row's logits score the next prompt token).
    prompt_logits: bool = False
    #: The sequence's prompt length, or None: positions below it are prompt tokens, the others
    #: generated ones, whose attention the backend computes the same way when a preempted
    #: sequence computes them again (see ``AttentionMetadata.prompt_lens``).
    prompt_len: int | None = None
    #: The slice's last tokens are this many proposed ones (speculative decoding): the step
    #: verifies them, so the logits of each of them and of the token before them are returned.
    num_spec_tokens: int = 0
    #: The LoRA adapter slot the slice's rows run with; -1: the base model.
    lora_slot: int = -1

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def logits_rows(self) -> range:
        """The rows of this slice (0 = its first token) whose logits the step returns: all of
        them for prompt logprobs, else the last ``1 + num_spec_tokens`` if it is sampled, else
        none."""
        length = len(self.token_ids)
        if self.prompt_logits:
            return range(length)
        return range(length - 1 - self.num_spec_tokens, length) if self.needs_logits else range(0)


@dataclass(frozen=True)
class TableEdit:
    """One sequence's block table after this step: the first ``keep`` blocks of the table the
    runner holds, then ``new_block_ids``. ``keep = 0`` sends a table whole (a new sequence, or
    one whose table changed at its first block); a running sequence that only grew keeps its
    whole table and sends the blocks it gained (none: its table did not change)."""

    seq_id: SeqId
    keep: int
    new_block_ids: list[int]


@dataclass(frozen=True)
class StepPlan:
    """Everything one forward pass computes: the slices in batch order, the block-table edits to
    apply first, the copy-on-write block copies ``(source, destination)`` to perform before it,
    and the moves between the pool and a second KV tier (None: no tier), performed around those
    copies in the order :mod:`pagedkv.memory.tier.transfers` gives, and the LoRA adapters to load
    into their slots. A plan without slices only moves blocks.

    The runner applies the tables' changes in field order: ``reset`` forgets every table,
    ``finished`` forgets those sequences' tables, then each of ``table_edits``."""

    slices: list[SeqSlice]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    kv_transfers: KVTransfers | None = None
    table_edits: list[TableEdit] = field(default_factory=list)
    #: Sequences whose tables the runner forgets: freed (finished, aborted, preempted) since
    #: the last plan.
    finished: list[SeqId] = field(default_factory=list)
    #: The runner forgets every table first: the first plan of a :class:`ShippedTables`, whose
    #: edits then send every slice's table whole (a runner that missed plans starts over here).
    reset: bool = False
    #: LoRA adapters to read into their slots before the forward pass, in order.
    lora_loads: list[SlotLoad] = field(default_factory=list)
    #: LoRA adapters' weights to write into their pages of the KV cache first (unified paging).
    lora_page_writes: list[PageWrite] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.slices)

    @property
    def num_logits(self) -> int:
        """Rows of logits the step returns: each slice's :meth:`SeqSlice.logits_rows`, in order."""
        return sum(len(s.logits_rows()) for s in self.slices)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepPlan:
        transfers = data.get("kv_transfers")
        return cls(
            slices=[SeqSlice(**s) for s in data["slices"]],
            block_copies=[(int(src), int(dst)) for src, dst in data["block_copies"]],
            kv_transfers=None if transfers is None else KVTransfers.from_dict(transfers),
            table_edits=[TableEdit(**edit) for edit in data.get("table_edits", [])],
            finished=list(data.get("finished", [])),
            reset=bool(data.get("reset", False)),
            lora_loads=[
                SlotLoad(**(load | {"pages": tuple(load.get("pages", ()))}))
                for load in data.get("lora_loads", [])
            ],
            lora_page_writes=[
                PageWrite(**(w | {"block_ids": tuple(w["block_ids"])}))
                for w in data.get("lora_page_writes", [])
            ],
        )


class ShippedTables:
    """The block tables as the plans sent them: what every runner holds, if it applied every
    plan made here since the first (which resets the runners' tables).

    :meth:`plan` compares each slice's table in the KV cache manager with the one sent and
    sends the difference; a sequence the manager no longer holds is sent as ``finished``. A
    table is compared whole (a C-level list compare: a running sequence's table is a few dozen
    ids), so the edits are right whatever changed it -- appends, copy-on-write, rollbacks,
    preemption and re-admission, forks."""

    def __init__(self) -> None:
        self._sent: dict[SeqId, list[int]] = {}
        self._reset = True

    def reset(self) -> None:
        """The next plan resets the runners' tables and sends every slice's table whole: for a
        runner that did not see every plan (one started afresh)."""
        self._sent.clear()
        self._reset = True

    def plan(
        self,
        slices: list[SeqSlice],
        kv_manager: KVCacheManager,
        block_copies: list[tuple[int, int]] | None = None,
        kv_transfers: KVTransfers | None = None,
        lora_loads: list[SlotLoad] | None = None,
        lora_page_writes: list[PageWrite] | None = None,
    ) -> StepPlan:
        """The plan of ``slices``, whose tables ``kv_manager`` holds, with the edits that bring
        the runners' tables to the manager's."""
        sent = self._sent
        finished = [seq_id for seq_id in sent if seq_id not in kv_manager]
        for seq_id in finished:
            del sent[seq_id]
        edits = []
        for piece in slices:
            table = kv_manager.block_ids(piece.seq_id)
            held = sent.get(piece.seq_id)
            if held is None:
                edits.append(TableEdit(piece.seq_id, 0, list(table)))
                sent[piece.seq_id] = list(table)
                continue
            keep = len(held)
            if len(table) == keep and table == held:
                continue  # unchanged (a decode within its last block): nothing to send
            if len(table) < keep or table[:keep] != held:
                keep = _common_prefix(held, table)
                del held[keep:]
            new = table[keep:]
            held.extend(new)
            edits.append(TableEdit(piece.seq_id, keep, new))
        reset, self._reset = self._reset, False
        loras = lora_loads or [], lora_page_writes or []
        return StepPlan(slices, block_copies or [], kv_transfers, edits, finished, reset, *loras)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
