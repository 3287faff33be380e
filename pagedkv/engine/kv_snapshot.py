"""The block map as plain records (``LLMEngine.kv_snapshot()``): per physical block its refcount,
whether the prefix cache holds its contents and which requests hold it, each live sequence's block
table, and the LoRA adapters resident in pages of the pool. Built by
:class:`~pagedkv.engine.stats.StatsCollector`; read by the dashboard's block map.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pagedkv.engine.core.adapter_paging import AdapterBlocks


@dataclass(frozen=True)
class BlockInfo:
    """One physical block: free (refcount 0, not cached), cached-free (refcount 0, cached) or
    in use by ``owners`` (request ids; a block shared by two samples of one request lists it
    once, ``refcount`` counts both)."""

    block_id: int
    refcount: int
    cached: bool
    owners: tuple[str, ...]
    #: The LoRA adapter whose weights the block holds (one of its pages, unified paging), if any.
    adapter: str | None = None


@dataclass(frozen=True)
class SequenceBlocks:
    """One live sequence's block table: logical block ``i`` is physical ``block_ids[i]``."""

    request_id: str
    #: The sample (``n > 1``) or beam index within its request.
    index: int
    block_ids: tuple[int, ...]
    num_tokens: int
    #: The request's prompt length and the prompt tokens the prefix cache served it.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: With KV groups, each group's table (``block_ids`` holds their blocks, null block aside).
    group_tables: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class KVSnapshot:
    """The pool as two flat records -- every block's refcount, the blocks the prefix cache holds
    -- and the live block tables; :attr:`blocks` joins them per block on first use (an object
    per block is the costly part, and a frequent reader such as the dashboard needs none)."""

    block_size: int
    refcounts: tuple[int, ...]
    cached: frozenset[int]
    sequences: list[SequenceBlocks]
    #: The resident LoRA adapters' pages (unified paging; none without it).
    adapters: tuple[AdapterBlocks, ...] = ()
    #: Per KV group its window (None: full attention; none without groups), and the null block.
    group_windows: tuple[int | None, ...] = ()
    null_block: int | None = None

    @cached_property
    def blocks(self) -> list[BlockInfo]:
        owners: list[list[str]] = [[] for _ in self.refcounts]
        for seq in self.sequences:
            for block in seq.block_ids:
                if seq.request_id not in owners[block]:
                    owners[block].append(seq.request_id)
        adapter_of = {block: a.name for a in self.adapters for block in a.block_ids}
        return [
            BlockInfo(block, refcount, block in self.cached, tuple(owners[block]), adapter_of.get(block))
            for block, refcount in enumerate(self.refcounts)
        ]
