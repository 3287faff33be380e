"""The paged side of every comparison: the real :class:`BlockPool` and :class:`BlockTable`.

Nothing here models paging; it only feeds request lengths to the allocator the engine uses and
reads its counters back, so a simulated figure is a figure of the real allocator.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.memory import BlockPool, BlockTable, PoolExhaustedError, blocks_for
from pagedkv.sim.breakdown import Breakdown
from pagedkv.sim.workloads import LiveRequest


def hold(pool: BlockPool, live: LiveRequest) -> BlockTable:
    """A table holding ``live``'s stored tokens, grown as an engine would: the prompt in one
    prefill, then the generated tokens. Raises :class:`PoolExhaustedError` if the pool is short."""
    table = BlockTable(pool)
    try:
        table.append_slots(live.request.prompt_len)
        table.append_slots(live.tokens - live.request.prompt_len)
    except PoolExhaustedError:
        table.free()
        raise
    return table


def paged_breakdown(live: Sequence[LiveRequest], block_size: int) -> tuple[Breakdown, int]:
    """Hold every live request in one pool of just enough blocks.

    Returns the breakdown (token states + the unfilled tails of last blocks; paged memory has no
    reservation and no external fragmentation) and the number of block-table entries.
    """
    tokens = sum(r.tokens for r in live)
    pool = BlockPool(max(sum(blocks_for(r.tokens, block_size) for r in live), 1), block_size)
    tables = [hold(pool, r) for r in live]
    held = pool.num_used_blocks * block_size
    return Breakdown(tokens, internal_fragmentation=held - tokens), sum(len(t.block_ids) for t in tables)
