"""Hypothesis interleaves KV allocations and LoRA adapter loads, pins and evictions in one pool.

A shadow model knows which sequences run and which adapter each uses; after every step the pool
must account for every block exactly once (no leak, refcounts equal holders), a pinned adapter
must keep the pages it had when pinned, and KV blocks plus adapter pages never exceed the pool.
"""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.memory import KVCacheManager, PoolExhaustedError
from pagedkv.memory.adapter_pages import AdapterPages, AdapterPagesError

BLOCK_SIZE = 2
PREFIXES = [[1, 2, 3, 4, 5], [3, 4, 1, 2], [7, 7, 7, 7]]
#: Adapter ids and their pages.
ADAPTERS = {"a": 1, "b": 2, "c": 3, "d": 5}
ADAPTER_OR_BASE = st.sampled_from([None, *ADAPTERS])


class AdapterPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 20), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching, watermark=0.0)
        self.pages = AdapterPages(self.kv.pool)
        self.running: dict[int, str | None] = {}  # seq -> its adapter (None: the base model)
        self.tokens: dict[int, list[int]] = {}
        self.pinned_pages: dict[str, list[int]] = {}  # adapter -> its pages when first pinned
        self.next_id = 0

    def _state(self):
        return self.kv.usage(), self.pages.resident(), {s: self.kv.block_ids(s) for s in self.running}

    def _started(self, seq, adapter, prompt):
        self.running[seq], self.tokens[seq] = adapter, list(prompt)
        if adapter is not None:
            self.pinned_pages.setdefault(adapter, self.pages.block_ids(adapter))

    def _stopped(self, seq):
        adapter = self.running.pop(seq)
        del self.tokens[seq]
        self.kv.free(seq)
        if adapter is not None:
            self.pages.unpin(adapter)
            if self.pages.pins(adapter) == 0:
                del self.pinned_pages[adapter]

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=5),
        adapter=ADAPTER_OR_BASE,
    )
    def admit(self, prefix, suffix, adapter):
        """The scheduler's admission: KV blocks and, for an adapter's request, its pages."""
        prompt, seq = prefix + suffix, self.next_id
        self.next_id += 1
        kv_blocks = self.kv.blocks_to_allocate(prompt)
        extra = 0 if adapter is None else self.pages.blocks_to_admit(adapter, ADAPTERS[adapter])
        fits = kv_blocks + extra <= self.kv.allocatable_blocks
        before = self._state()
        try:
            if adapter is None:
                self.kv.allocate(seq, prompt)
            else:
                self.pages.admit(adapter, ADAPTERS[adapter], kv_blocks, lambda: self.kv.allocate(seq, prompt))
        except (PoolExhaustedError, AdapterPagesError):
            assert not fits, "refused although its blocks and pages were counted as free"
            assert self._state() == before
            return
        assert fits, "admitted although its blocks and pages were not counted as free"
        self._started(seq, adapter, prompt)
        self.kv.cache_computed_blocks(seq, prompt, len(prompt))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def decode(self, data):
        seq = data.draw(st.sampled_from(sorted(self.running)))
        before = self._state()
        if self.kv.try_append(seq, 1) is None:
            assert self._state() == before
            return
        self.tokens[seq].append(0)
        self.kv.cache_computed_blocks(seq, self.tokens[seq], len(self.tokens[seq]))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.running)))
        child, adapter = self.next_id, self.running[parent]
        self.next_id += 1
        self.kv.fork(parent, child)
        if adapter is not None:
            self.pages.pin(adapter)
        self._started(child, adapter, self.tokens[parent])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._stopped(data.draw(st.sampled_from(sorted(self.running))))

    @rule(adapter=st.sampled_from(list(ADAPTERS)))
    def load(self, adapter):
        """A user's load ahead of use: resident and idle, or refused with nothing changed."""
        fits = self.pages.is_resident(adapter) or ADAPTERS[adapter] <= self.kv.pool.num_free_blocks
        before = self._state()
        try:
            self.pages.load(adapter, ADAPTERS[adapter])
        except AdapterPagesError:
            assert not fits and self._state() == before
            return
        assert fits and self.pages.is_resident(adapter)

    @rule(adapter=st.sampled_from(list(ADAPTERS)))
    def unload(self, adapter):
        pinned = self.pages.pins(adapter) > 0
        try:
            self.pages.unload(adapter)
        except ValueError:
            assert pinned
            return
        assert not pinned and not self.pages.is_resident(adapter)

    @rule()
    def worker_step(self):
        """What the worker is told: every write is a resident adapter's current pages, and an
        adapter evicted since the last step is either gone or written again."""
        writes = dict(self.pages.take_writes())
        for adapter, blocks in writes.items():
            assert list(blocks) == self.pages.block_ids(adapter)
        for adapter in self.pages.take_evicted():
            assert not self.pages.is_resident(adapter) or adapter in writes

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def every_block_is_held_or_free_once(self):
        pool = self.kv.pool
        free, cached_free = pool.free_block_ids(), pool.cached_free_block_ids()
        in_use = [b for b in range(pool.num_blocks) if pool.refcount(b) > 0]
        assert len(free) + len(cached_free) + len(in_use) == pool.num_blocks
        assert len(set(free) | set(cached_free) | set(in_use)) == pool.num_blocks

    @invariant()
    def refcounts_equal_holders(self):
        table_blocks = Counter(b for seq in self.running for b in self.kv.block_ids(seq))
        adapter_blocks = Counter(b for r in self.pages.resident() for b in r.block_ids)
        assert not set(table_blocks) & set(adapter_blocks), "an adapter page is in a block table"
        assert all(count == 1 for count in adapter_blocks.values()), "a page held by two adapters"
        holders = table_blocks + adapter_blocks
        pool = self.kv.pool
        assert [pool.refcount(b) for b in range(pool.num_blocks)] == [
            holders[b] for b in range(pool.num_blocks)
        ]
        assert not any(b in pool.prefix_cache for b in adapter_blocks), "an adapter page is cached"
        assert len(table_blocks) + sum(adapter_blocks.values()) <= pool.num_blocks

    @invariant()
    def pins_equal_running_users_and_pinned_pages_stay(self):
        users = Counter(a for a in self.running.values() if a is not None)
        for adapter in ADAPTERS:
            assert self.pages.pins(adapter) == users[adapter]
        for adapter, blocks in self.pinned_pages.items():
            assert self.pages.block_ids(adapter) == blocks, "a pinned adapter moved or was evicted"

    @invariant()
    def idle_pages_are_the_reclaimable_free_blocks(self):
        usage, pool = self.pages.usage(), self.kv.pool
        idle = sum(len(r.block_ids) for r in self.pages.resident() if r.pins == 0)
        assert usage.idle_pages == idle == self.pages.reclaimable_blocks
        assert pool.num_free_blocks == len(pool.free_block_ids()) + pool.num_cached_free_blocks + idle

    def teardown(self):
        for seq in list(self.running):
            self._stopped(seq)
        for adapter in ADAPTERS:
            self.pages.unload(adapter)
        pool = self.kv.pool
        assert pool.num_used_blocks == 0 and self.pages.usage().resident_pages == 0
        assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))


TestAdapterPoolInvariants = AdapterPoolMachine.TestCase
TestAdapterPoolInvariants.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
