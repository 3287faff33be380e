"""Hypothesis drives the memory layer with random interleavings and checks it after every step.

A shadow model records, for every physical block, which tokens were written into it and the
full token prefix before it, and the cache salt of the sequence that wrote it. That lets the
test check the promises that matter: a block is never written while shared (copy-on-write did
its job), and a prefix-cache hit always hands back blocks computed for exactly the same prefix
under the same salt (tenants never share a block).
"""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.memory import KVCacheManager, PoolExhaustedError, is_root

BLOCK_SIZE = 2
# Overlapping on purpose: (3, 4) is a second block in one prefix and a first block in another.
PREFIXES = [[1, 2, 3, 4, 5], [3, 4, 1, 2], [1, 2, 9], [7, 7, 7, 7]]
SALTS = [None, "tenant-a", "tenant-b"]


class CacheMirror:
    """A KVCacheListener that rebuilds the prefix cache from its events alone, as a router does.

    It checks the order the events promise: a block is stored under a parent it already knows
    and removed only while it knows it.
    """

    def __init__(self):
        self.blocks: dict[int, tuple[int, tuple[int, ...]]] = {}

    def block_stored(self, block_id, parent, token_ids):
        assert block_id not in self.blocks, "stored twice without a removal in between"
        assert is_root(parent) or parent in self.blocks, "stored under a parent nobody announced"
        self.blocks[block_id] = (parent, tuple(token_ids))

    def blocks_removed(self, block_ids):
        for block in block_ids:
            del self.blocks[block]

    def all_blocks_cleared(self):
        self.blocks.clear()


class MemoryMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching, watermark=0.0)
        self.tokens: dict[int, list[int]] = {}  # the sequence's tokens whose KV was written
        self.block_prefix: dict[int, tuple] = {}  # block -> tokens before it (when written)
        self.block_data: dict[int, list] = {}  # block -> tokens written into it
        self.salt: dict[int, str | None] = {}  # seq -> its cache salt
        self.block_salt: dict[int, str | None] = {}  # block -> the salt of the sequence that wrote it
        self.next_id = 0
        self.mirror = CacheMirror()
        self.kv.set_listener(self.mirror)

    # -- shadow KV ------------------------------------------------------------------------
    def _write(self, seq, start):
        table = self.kv.table(seq)
        toks = self.tokens[seq]
        for pos in range(start, len(toks)):
            block = table.block_ids[pos // BLOCK_SIZE]
            assert self.kv.pool.refcount(block) == 1, "wrote into a shared block"
            offset = pos % BLOCK_SIZE
            data = self.block_data.setdefault(block, [None] * BLOCK_SIZE)
            if offset == 0:
                self.block_prefix[block] = tuple(toks[:pos])
                self.block_salt[block] = self.salt[seq]
            data[offset] = toks[pos]

    def _copy(self, pairs):
        for src, dst in pairs:
            self.block_data[dst] = list(self.block_data[src])
            self.block_prefix[dst] = self.block_prefix[src]
            self.block_salt[dst] = self.block_salt[src]

    # -- rules ----------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=6),
        computed=st.floats(0, 1),
        salt=st.sampled_from(SALTS),
    )
    def add_request(self, prefix, suffix, computed, salt):
        prompt = prefix + suffix
        seq = self.next_id
        self.next_id += 1
        before = self.kv.usage()
        if self.kv.blocks_to_allocate(prompt, cache_salt=salt) > self.kv.allocatable_blocks:
            try:
                self.kv.allocate(seq, prompt, cache_salt=salt)
            except PoolExhaustedError:
                assert self.kv.usage() == before and seq not in self.kv
                return
            # blocks_to_allocate may be conservative only through the watermark (0 here).
            raise AssertionError("allocate succeeded where blocks_to_allocate said no room")
        hit = self.kv.allocate(seq, prompt, cache_salt=salt)
        assert hit % BLOCK_SIZE == 0 and hit < len(prompt)
        self.salt[seq] = salt
        table = self.kv.table(seq)
        for i in range(hit // BLOCK_SIZE):
            block = table.block_ids[i]
            assert self.block_salt[block] == salt, "a hit handed out another salt's block"
            assert self.block_prefix[block] == tuple(prompt[: i * BLOCK_SIZE])
            assert self.block_data[block] == prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        self.tokens[seq] = list(prompt)
        self._write(seq, hit)
        # Chunked prefill: only part of the prompt may count as computed by now.
        done = max(hit, int(computed * len(prompt)))
        self.kv.cache_computed_blocks(seq, prompt, done)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 3), asking=st.booleans())
    def decode(self, data, token, asking):
        """Grow by one token, as ``append_slots`` or as the scheduler's ``try_append``."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = (self.kv.usage(), list(self.kv.block_ids(seq)))
        try:
            copies = self.kv.try_append(seq, 1) if asking else self.kv.append_slots(seq, 1)
        except PoolExhaustedError:
            copies = None
        if copies is None:
            assert not self.kv.can_append(seq, 1)
            assert (self.kv.usage(), list(self.kv.block_ids(seq))) == before
            return
        self._copy(copies)
        self.tokens[seq].append(token)
        self._write(seq, len(self.tokens[seq]) - 1)
        self.kv.cache_computed_blocks(seq, self.tokens[seq], len(self.tokens[seq]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salt[child] = self.salt[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(seq)
        del self.tokens[seq]

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def accounting_is_exact(self):
        pool = self.kv.pool
        free = pool.free_block_ids()
        cached_free = pool.cached_free_block_ids()
        in_use = [b for b in range(pool.num_blocks) if pool.refcount(b) > 0]
        assert len(free) + len(cached_free) + len(in_use) == pool.num_blocks
        assert len(set(free) | set(cached_free) | set(in_use)) == pool.num_blocks  # no block twice
        assert all(b in pool.prefix_cache for b in cached_free)
        assert not any(b in pool.prefix_cache for b in free)

    @invariant()
    def cache_is_a_closed_tree(self):
        """Every cached block hangs under a root or another cached block: no orphan can be
        reached through a recycled parent id."""
        cache = self.kv.pool.prefix_cache
        for block in cache.blocks():
            parent = cache.parent_of(block)
            assert is_root(parent) or parent in cache

    @invariant()
    def events_rebuild_the_cache(self):
        """Replaying the listener's events gives exactly the cached blocks and their contents."""
        cache = self.kv.pool.prefix_cache
        assert set(self.mirror.blocks) == set(cache.blocks())
        for block, (parent, tokens) in self.mirror.blocks.items():
            assert cache.parent_of(block) == parent
            assert cache.lookup(parent, tokens) == block

    @invariant()
    def refcounts_equal_holders(self):
        holders = Counter(b for seq in self.tokens for b in self.kv.block_ids(seq))
        pool = self.kv.pool
        for block in range(pool.num_blocks):
            assert pool.refcount(block) == holders.get(block, 0)
        assert pool.num_shared_blocks == sum(1 for count in holders.values() if count > 1)
        for seq, toks in self.tokens.items():
            private = sum(1 for b in self.kv.block_ids(seq) if holders[b] == 1)
            assert self.kv.private_blocks(seq) == private
            table = self.kv.table(seq)
            assert table.num_tokens == len(toks)
            assert len(table.block_ids) == -(-len(toks) // BLOCK_SIZE)

    def teardown(self):
        for seq in list(self.tokens):
            self.kv.free(seq)
        usage = self.kv.usage()
        assert usage.used_blocks == 0 and usage.free_blocks == usage.total_blocks


TestMemoryInvariants = MemoryMachine.TestCase
TestMemoryInvariants.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
