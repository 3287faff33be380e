"""Step plans written out in tests: each slice with its whole block table."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine.core.plan import SeqSlice, StepPlan, TableEdit
from pagedkv.engine.worker.runner_tables import RunnerTables
from pagedkv.engine.worker.step_inputs import StepArrays, step_arrays


@dataclass(frozen=True)
class Piece:
    """A :class:`SeqSlice` without its sequence id, with the block table it reads."""

    token_ids: list[int]
    start: int
    table: list[int]
    needs_logits: bool
    prompt_logits: bool = False
    prompt_len: int | None = None
    num_spec_tokens: int = 0


def plan_of(pieces: list[Piece], block_copies: list[tuple[int, int]] | None = None) -> StepPlan:
    """A plan of sequences ``0 .. len(pieces) - 1`` that resets the runner's tables and sends
    each one's table whole."""
    slices = [
        SeqSlice(i, p.token_ids, p.start, p.needs_logits, p.prompt_logits, p.prompt_len, p.num_spec_tokens)
        for i, p in enumerate(pieces)
    ]
    edits = [TableEdit(i, 0, list(p.table)) for i, p in enumerate(pieces)]
    return StepPlan(slices, block_copies or [], table_edits=edits, reset=True)


def plan_arrays(plan: StepPlan, block_size: int, num_blocks: int) -> StepArrays:
    """The plan's arrays, read from a runner's tables that applied it alone."""
    tables = RunnerTables()
    tables.apply(plan)
    return step_arrays(plan, tables, block_size, num_blocks)
