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

With ``hash_blocks`` the cache also names each block by its chained content hash
(:mod:`pagedkv.memory.block_hash`), computed once when the block is inserted: what a second KV
tier keys blocks by once they leave the pool.

A first block's parent is a *root*, a negative id no block has: :data:`ROOT` for an unsalted
request, the salt's root hash (:func:`~pagedkv.memory.block_hash.salted_root`) for a request
with a ``cache_salt``. Requests share a cached chain only if they share its root.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagedkv.memory.block_hash import block_hash, salted_root

#: Parent id of an unsalted sequence's first block.
ROOT = -1


def root_of(cache_salt: str | None) -> int:
    """The parent id of a first block under ``cache_salt``: :data:`ROOT` without a salt, else
    the salt's root hash (<= -2)."""
    root = salted_root(cache_salt)
    return ROOT if root is None else root


def is_root(parent: int) -> bool:
    """Whether ``parent`` is a root (the block under it is a first block), not a block id."""
    return parent < 0


def root_hash(root: int) -> int | None:
    """The parent hash a first block under ``root`` is hashed with (None: unsalted)."""
    return None if root == ROOT else root


def root_of_hash(parent_hash: int | None) -> int:
    """The root a first block hashed under ``parent_hash`` hangs from (:func:`root_hash`'s
    inverse)."""
    return ROOT if parent_hash is None else parent_hash


BlockKey = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class RemovedBlock:
    """A cached block as the cache holds it (or held it, once forgotten): its key and (with
    ``hash_blocks``) its hash, its parent's (None for a first block) and the root its chain
    starts from (which names the chain's tenant or LoRA adapter; None without hashing)."""

    block_id: int
    key: BlockKey
    block_hash: int | None
    parent_hash: int | None
    root: int | None = None


class PrefixCache:
    """Map (parent block id, token ids) -> block id, with the inverse for eviction."""

    def __init__(self, hash_blocks: bool = False) -> None:
        self._by_key: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._children: dict[int, set[int]] = {}
        #: block id -> chained content hash of every cached block (None: not hashing)
        self._hash_of: dict[int, int] | None = {} if hash_blocks else None
        #: block id -> the root of its chain, kept beside its hash (what a second tier names)
        self._root_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._key_of

    def lookup(self, parent: int, token_ids: Sequence[int]) -> int | None:
        return self._by_key.get((parent, tuple(token_ids)))

    def match(
        self, token_ids: Sequence[int], block_size: int, max_blocks: int, root: int = ROOT
    ) -> list[int]:
        """The longest chain of cached blocks under ``root`` covering a prefix of ``token_ids``."""
        chain: list[int] = []
        parent = root
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
        if not is_root(parent):
            self._children.setdefault(parent, set()).add(block_id)
        if self._hash_of is not None:  # a parent is always cached (the cache is a closed tree)
            parent_hash = root_hash(parent) if is_root(parent) else self._hash_of[parent]
            self._hash_of[block_id] = block_hash(parent_hash, key[1])
            self._root_of[block_id] = parent if is_root(parent) else self._root_of[parent]
        return True

    def remove(self, block_id: int) -> list[int]:
        """Forget ``block_id`` and all its cached descendants; return every block forgotten."""
        return [removed.block_id for removed in self.remove_entries(block_id)]

    def remove_entries(self, block_id: int) -> list[RemovedBlock]:
        """:meth:`remove`, saying what each forgotten block held (parents before children)."""
        if not self._children.get(block_id):  # a leaf, as an evicted block usually is
            if block_id not in self._key_of:
                return []
            removed = [self._forget(block_id)]
            self._children.pop(block_id, None)
            siblings = self._children.get(removed[0].key[0])
            if siblings is not None:
                siblings.discard(block_id)
        else:
            removed = []
            stack = [block_id]
            while stack:
                block = stack.pop()
                if block not in self._key_of:
                    continue
                removed.append(self._forget(block))
                parent = removed[-1].key[0]
                if not is_root(parent) and parent in self._children:
                    self._children[parent].discard(block)
                stack.extend(self._children.pop(block, ()))
        if self._hash_of is not None:  # only now: a child's entry read its parent's hash
            for entry in removed:
                del self._hash_of[entry.block_id], self._root_of[entry.block_id]
        return removed

    def entry(self, block_id: int) -> RemovedBlock:
        """What cached block ``block_id`` holds, as :meth:`remove_entries` would report it."""
        key = self._key_of[block_id]
        if self._hash_of is None:
            return RemovedBlock(block_id, key, None, None)
        parent_hash = root_hash(key[0]) if is_root(key[0]) else self._hash_of[key[0]]
        return RemovedBlock(block_id, key, self._hash_of[block_id], parent_hash, self._root_of[block_id])

    def _forget(self, block_id: int) -> RemovedBlock:
        removed = self.entry(block_id)
        del self._key_of[block_id], self._by_key[removed.key]
        return removed

    def hash_of(self, block_id: int) -> int:
        """The chained content hash of a cached block (a cache built with ``hash_blocks``)."""
        if self._hash_of is None:
            raise ValueError("this prefix cache does not hash its blocks (hash_blocks=False)")
        return self._hash_of[block_id]

    @property
    def hashes_blocks(self) -> bool:
        return self._hash_of is not None

    def blocks(self) -> Iterator[int]:
        return iter(self._key_of)

    def token_ids_of(self, block_id: int) -> tuple[int, ...]:
        """The tokens a cached block holds."""
        return self._key_of[block_id][1]

    def parent_of(self, block_id: int) -> int:
        """The cached block that ``block_id`` is chained under (a root for a first block)."""
        return self._key_of[block_id][0]
