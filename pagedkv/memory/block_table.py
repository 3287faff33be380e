"""One sequence's map from logical blocks (its token positions) to physical blocks.

Like a page table: the sequence sees positions 0..n-1 in order; the physical blocks behind them
can sit anywhere in the pool and can be shared with other sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import PoolExhaustedError
from pagedkv.memory.prefix_cache import ROOT

CopyPair = tuple[int, int]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: the real length rounded up to a block."""
    return -(-num_tokens // block_size)


class BlockTable:
    """A sequence's blocks and token count. Holds one reference to each of its blocks."""

    def __init__(
        self, pool: BlockPool, block_ids: Sequence[int] = (), num_tokens: int = 0, root: int = ROOT
    ) -> None:
        """Wrap blocks the caller already holds a reference to (e.g. prefix-cache hits);
        ``root`` is the prefix-cache parent of the first block (its request's salt)."""
        if num_tokens > len(block_ids) * pool.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks")
        self.pool = pool
        self.block_ids: list[int] = list(block_ids)
        self.num_tokens = num_tokens
        #: Leading blocks already registered in the prefix cache (the manager advances it).
        self.num_cached_blocks = 0
        #: The prefix-cache root the first block is chained under (``ROOT``: unsalted).
        self.root = root

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def capacity(self) -> int:
        """Token slots held: the waste is ``capacity - num_tokens`` (< one block)."""
        return len(self.block_ids) * self.block_size

    def _last_block_is_shared_partial(self) -> bool:
        return (
            self.num_tokens % self.block_size != 0
            and self.num_tokens > 0
            and self.pool.refcount(self.block_ids[-1]) > 1
        )

    def blocks_needed(self, n: int) -> int:
        """New blocks ``append_slots(n)`` would take, a copy-on-write copy included."""
        if n <= 0:
            return 0
        grow = blocks_for(self.num_tokens + n, self.block_size) - len(self.block_ids)
        return max(grow, 0) + int(self._last_block_is_shared_partial())

    def append_slots(self, n: int) -> list[CopyPair]:
        """Make room for ``n`` more tokens; return the (source, destination) block copies due.

        Blocks are taken only on block boundaries. If the last block is partially filled and
        shared (after a fork), it is copied first -- copy-on-write -- and only that block: the
        caller must copy the data of each returned pair before writing. All or nothing: if the
        pool is short, :class:`PoolExhaustedError` is raised and nothing changes.
        """
        copies = self.try_append(n)
        if copies is None:
            needed = self.blocks_needed(n)
            raise PoolExhaustedError(needed, self.pool.num_free_blocks, self.pool.num_blocks)
        return copies

    def try_append(self, n: int) -> list[CopyPair] | None:
        """:meth:`append_slots`, or None (and nothing changes) when the pool is short: the
        scheduler's question "can it grow?" and the growth in one look at the table."""
        # Fast path, taken by all but one decode step per block: the token fits in a private
        # last block.
        if 0 < n <= len(self.block_ids) * self.pool.block_size - self.num_tokens:
            if self.pool.refcount(self.block_ids[-1]) == 1:
                self.num_tokens += n
                return []
        if n < 0:
            raise ValueError(f"cannot append a negative number of slots ({n})")
        shared_partial = self._last_block_is_shared_partial()
        grow = max(blocks_for(self.num_tokens + n, self.block_size) - len(self.block_ids), 0)
        if n and grow + shared_partial > self.pool.num_free_blocks:
            return None
        copies: list[CopyPair] = []
        if n and shared_partial:
            shared = self.block_ids[-1]
            (private,) = self.pool.allocate(1)
            self.pool.free([shared])
            self.block_ids[-1] = private
            copies.append((shared, private))
        if grow:
            self.block_ids.extend(self.pool.allocate(grow))
        self.num_tokens += n
        return copies

    def truncate(self, num_tokens: int, free_blocks: bool = True) -> None:
        """Forget the tokens from ``num_tokens`` on (rejected speculative tokens); with
        ``free_blocks``, blocks past the last one still holding a token return to the pool.

        Such a block only ever held tokens appended since they were computed, never registered
        in the prefix cache nor shared (a fork or a cache hit shares blocks of verified tokens):
        it is private and uncached, which is checked.
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a table of {self.num_tokens} tokens to {num_tokens}")
        keep = blocks_for(num_tokens, self.block_size) if free_blocks else len(self.block_ids)
        emptied = self.block_ids[keep:]
        for block in emptied:
            if self.pool.refcount(block) != 1 or block in self.pool.prefix_cache:
                raise RuntimeError(f"block {block} past the kept tokens is shared or cached")
        self.num_tokens = num_tokens
        if emptied:
            del self.block_ids[keep:]
            self.pool.free(reversed(emptied))

    def reserve(self, num_tokens: int) -> None:
        """Hold blocks for ``num_tokens`` slots now, as a contiguous allocator would.

        Only the capacity grows; appends then fill the reserved blocks without allocating.
        """
        missing = blocks_for(num_tokens, self.block_size) - len(self.block_ids)
        if missing > 0:
            self.block_ids.extend(self.pool.allocate(missing))

    def fork(self) -> BlockTable:
        """A child that shares every block (refcount + 1); writes diverge by copy-on-write."""
        for block in self.block_ids:
            self.pool.incref(block)
        child = BlockTable(self.pool, self.block_ids, self.num_tokens, self.root)
        child.num_cached_blocks = self.num_cached_blocks
        return child

    def free(self) -> None:
        """Drop this table's references, tail first (see :meth:`BlockPool.free`)."""
        self.pool.free(reversed(self.block_ids))
        self.block_ids = []
        self.num_tokens = 0
        self.num_cached_blocks = 0

    def slot(self, position: int) -> int:
        """Physical slot (block_id * block_size + offset) of logical token ``position``."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} outside the table's {self.capacity} slots")
        block, offset = divmod(position, self.block_size)
        return self.block_ids[block] * self.block_size + offset

    def slots(self, start: int, end: int) -> list[int]:
        """Physical slots of logical positions ``start..end-1``."""
        bs = self.block_size
        if not 0 <= start <= end <= self.capacity:
            raise IndexError(f"positions {start}..{end} outside the table's {self.capacity} slots")
        return [self.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
