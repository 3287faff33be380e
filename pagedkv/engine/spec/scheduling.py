"""Where a step's proposed tokens go: after the decodes that proposed them, in their own slots.

The scheduler gives every running decode its one slot first (preempting if the pool runs dry,
as without speculation), then hands the step to :func:`add_spec_tokens`, which extends each
decode by the tokens its sequence proposed while the token budget and the free blocks allow.
So speculation never preempts anything and never takes a block a decode needs: a proposal that
does not fit is dropped, and its sequence decodes one token as it would have without it. The
verified slice's rejected tokens are rolled back after the step (by the commit point,
:func:`~pagedkv.engine.core.commit.update_from_output`).
"""

from __future__ import annotations

from pagedkv.engine.core.scheduler_output import SchedulerOutput
from pagedkv.memory import KVCacheManager


def add_spec_tokens(out: SchedulerOutput, kv_manager: KVCacheManager, budget: int) -> int:
    """Extend ``out``'s scheduled decodes by their sequences' ``spec_token_ids`` (trimmed to
    ``budget``, dropped when the pool cannot hold them); returns the budget left. A sequence
    whose proposal was trimmed or dropped keeps what the step verifies in ``spec_token_ids``."""
    for i, item in enumerate(out.scheduled):
        seq = item.seq
        if not seq.spec_token_ids:
            continue
        proposal = seq.spec_token_ids[:budget]
        copies = kv_manager.try_append(seq.seq_id, len(proposal)) if proposal else None
        if copies is None:  # no budget, or the pool is short: decode plainly
            seq.spec_token_ids = []
            continue
        out.block_copies.extend(copies)
        seq.spec_token_ids = proposal
        out.scheduled[i] = item.with_spec_tokens(tuple(proposal))
        budget -= len(proposal)
    return budget
