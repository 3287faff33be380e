"""The chained content hash of a full KV block: the name a block keeps in every tier.

A block id names a place in the pool and is recycled; a block *hash* names the contents: the
hash of the parent block's hash and this block's token ids (sha256, the first 8 bytes as a
non-negative 63-bit int). It is what vLLM's KV events announce, what the second tier is keyed
by, and what a file of the disk tier is named after, so the same prefix has the same name on
every replica, in every medium, and after a restart.

A request's ``cache_salt`` (vLLM's) enters the hash of its first block, so every hash of its
chain differs from an unsalted one's: tenants that salt differently never share a cached block,
in the pool, in a second tier, or after a restart (a hit would tell one tenant, by its latency,
what another has asked). The first block's parent is then the salt's *root*
(:func:`salted_root`), a negative int: never a block's hash, which is non-negative.

A hash alone is never trusted to hand out keys and values: whoever keys by it also keeps the
block's parent hash and token ids and compares them on every hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack

#: Parent hash of a sequence's first block: fixed, so every replica and every run hashes alike.
ROOT_HASH_SEED = b"pagedkv-kv-events"


def salted_root(cache_salt: str | None) -> int | None:
    """The parent hash of a first block under ``cache_salt``: None without a salt, else a
    negative 64-bit int derived from it (62 bits of sha256: two salts share a root only if
    someone finds a second preimage of those bits)."""
    if cache_salt is None:
        return None
    digest = hashlib.sha256(ROOT_HASH_SEED + b"\x00cache_salt\x00" + cache_salt.encode()).digest()
    return -2 - (int.from_bytes(digest[:8], "big") >> 2)


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The chained content hash of one full block (``parent_hash`` None for an unsalted first
    block, the :func:`salted_root` of its salt for a salted one)."""
    prefix = ROOT_HASH_SEED if parent_hash is None else parent_hash.to_bytes(8, "big", signed=True)
    digest = hashlib.sha256(prefix + msgpack.packb(list(token_ids))).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def chain_hashes(
    token_ids: Sequence[int], block_size: int, start: int, stop: int, parent_hash: int | None
) -> list[int]:
    """Hashes of the full blocks ``start .. stop - 1`` of ``token_ids``, chained under
    ``parent_hash`` (the hash of block ``start - 1``, None when ``start`` is 0)."""
    hashes = []
    for i in range(start, stop):
        parent_hash = block_hash(parent_hash, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent_hash)
    return hashes
