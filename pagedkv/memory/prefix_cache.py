"""Content addressing of full KV blocks, so requests that share a prefix share its blocks.

A full block is addressed by the pair (parent block, its token ids). That pair *is* the chained
hash of the prefix -- the parent stands for everything before it -- but kept as a dictionary key
it is compared exactly on every hit: the token ids are verified, so a hash collision can never
hand out the wrong keys and values. Because a block id is recycled after eviction, evicting a
block also forgets every cached descendant (see :meth:`PrefixCache.remove`): a recycled id can
never vouch for a stale child. The structure is a prefix tree at block granularity, the same
shape as SGLang's radix cache, stored as a flat map.

Only *full* blocks are cached. A shared prefix shorter than one block can never hit, and a hit
never covers a prompt's last token: its logits must be computed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

#: Parent id of a sequence's first block.
ROOT = -1

BlockKey = tuple[int, tuple[int, ...]]


class PrefixCache:
    """Map (parent block id, token ids) -> block id, with the inverse for eviction."""

    def __init__(self) -> None:
        self._by_key: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._children: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._key_of

    def lookup(self, parent: int, token_ids: Sequence[int]) -> int | None:
        return self._by_key.get((parent, tuple(token_ids)))

    def match(self, token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
        """The longest chain of cached blocks covering a prefix of ``token_ids``."""
        chain: list[int] = []
        parent = ROOT
        for i in range(max_blocks):
            block = self.lookup(parent, token_ids[i * block_size : (i + 1) * block_size])
            if block is None:
                break
            chain.append(block)
            parent = block
        return chain

    def insert(self, block_id: int, parent: int, token_ids: Sequence[int]) -> bool:
        """Register a full block. False if the content is already cached under another block."""
        key = (parent, tuple(token_ids))
        if key in self._by_key or block_id in self._key_of:
            return False
        self._by_key[key] = block_id
        self._key_of[block_id] = key
        if parent != ROOT:
            self._children.setdefault(parent, set()).add(block_id)
        return True

    def remove(self, block_id: int) -> list[int]:
        """Forget ``block_id`` and all its cached descendants; return every block forgotten."""
        if not self._children.get(block_id):  # a leaf, as an evicted block usually is
            key = self._key_of.pop(block_id, None)
            if key is None:
                return []
            del self._by_key[key]
            self._children.pop(block_id, None)
            siblings = self._children.get(key[0])
            if siblings is not None:
                siblings.discard(block_id)
            return [block_id]
        forgotten: list[int] = []
        stack = [block_id]
        while stack:
            block = stack.pop()
            key = self._key_of.pop(block, None)
            if key is None:
                continue
            del self._by_key[key]
            parent = key[0]
            if parent != ROOT and parent in self._children:
                self._children[parent].discard(block)
            stack.extend(self._children.pop(block, ()))
            forgotten.append(block)
        return forgotten

    def blocks(self) -> Iterator[int]:
        return iter(self._key_of)

    def parent_of(self, block_id: int) -> int:
        """The cached block that ``block_id`` is chained under (ROOT for a first block)."""
        return self._key_of[block_id][0]
