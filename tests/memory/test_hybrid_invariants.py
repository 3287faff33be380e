"""Hypothesis drives the hybrid KV cache manager (a table per KV group, sliding groups handing
blocks back) with random interleavings of prompts computed in chunks (the sliding groups
allocating each chunk's blocks as it comes, or the whole prompt at admission), decode steps past
the window, speculative rollbacks, forks, frees, preemptions and prefix hits, and checks it after
every step.

A shadow records what each physical block holds (its group, the tokens before it, its tokens):
a block is never written while shared, never written once out of every window (the null
block), and a prefix hit hands back, in every group, blocks computed for exactly that prefix.
"""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.memory import PoolExhaustedError
from pagedkv.memory.block_table import blocks_for
from pagedkv.memory.grouped_table import WindowedBlockTable
from pagedkv.memory.hybrid_manager import HybridKVCacheManager
from pagedkv.memory.kv_groups import plan_kv_groups

BLOCK_SIZE = 2
PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5]]
#: per layer windows: Gemma-2-like, Gemma-3-like, uniform windows (Mistral), two window sizes
LAYOUTS = [(None, 3), (None, 2, 2, 2, 2, 2), (4, 4), (None, None, 1, 1, 5, 5)]


class HybridMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 40),
        caching=st.booleans(),
        layout=st.sampled_from(LAYOUTS),
        chunk=st.sampled_from([None, 1, 2, 3, 5]),
    )
    def setup(self, num_blocks, caching, layout, chunk):
        self.groups = plan_kv_groups(layout)
        self.kv = HybridKVCacheManager(num_blocks, self.groups, BLOCK_SIZE, caching, 0.0, chunk)
        self.chunk = chunk
        self.tokens: dict[int, list[int]] = {}
        #: per sequence: tokens computed (below its length: its prompt is still being computed),
        #: and the tokens it was admitted with
        self.computed: dict[int, int] = {}
        self.admitted: dict[int, int] = {}
        self.content: dict[int, tuple] = {}  # block -> (group, tokens before it, its tokens)
        self.next_id = 0

    # -- shadow KV ------------------------------------------------------------------------
    def _write(self, seq, start, end):
        """The step computing positions ``start..end-1`` writes every group's slots."""
        toks = self.tokens[seq]
        for g, table in enumerate(self.kv.grouped(seq).tables):
            for pos in range(start, end):
                i, offset = divmod(pos, BLOCK_SIZE)
                block = table.block_ids[i]
                assert block != self.kv.null_block, "wrote into the null block"
                assert self.kv.pool.refcount(block) == 1, "wrote into a shared block"
                group, before, data = self.content.get(block, (g, (), ()))
                if offset == 0:
                    group, before, data = g, tuple(toks[: i * BLOCK_SIZE]), ()
                # (a rolled-back draft token may still sit past ``offset``: it is overwritten)
                assert group == g and len(data) >= offset
                self.content[block] = (group, before, (*data[:offset], toks[pos]))

    def _check_hits(self, seq, cached):
        toks = self.tokens[seq]
        for g, table in enumerate(self.kv.grouped(seq).tables):
            for i, block in enumerate(table.block_ids[: cached // BLOCK_SIZE]):
                if block != self.kv.null_block:
                    expected = (
                        g,
                        tuple(toks[: i * BLOCK_SIZE]),
                        tuple(toks[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]),
                    )
                    assert self.content[block] == expected, "a prefix hit handed back another prefix's block"

    def _copy(self, pairs):
        for src, dst in pairs:
            self.content[dst] = self.content[src]

    def _step_done(self, seq):
        self.kv.cache_computed_blocks(seq, self.tokens[seq], len(self.tokens[seq]))

    def _admit(self, seq, toks):
        """Allocate and compute the first chunk (the engine's admission step); False: no room."""
        predicted = self.kv.blocks_to_allocate(toks)
        free = self.kv.pool.num_free_blocks
        try:
            cached = self.kv.allocate(seq, toks)
        except PoolExhaustedError:
            assert predicted > free
            assert seq not in self.kv
            return False
        assert free - self.kv.pool.num_free_blocks == predicted
        self.tokens[seq], self.admitted[seq] = toks, len(toks)
        self._check_hits(seq, cached)
        end = len(toks) if self.chunk is None else min(len(toks), cached + self.chunk)
        self._compute(seq, cached, end)
        return True

    def _compute(self, seq, start, end):
        self._write(seq, start, end)
        self.kv.cache_computed_blocks(seq, self.tokens[seq], end)
        self.computed[seq] = end

    def _forget(self, seq):
        for held in (self.tokens, self.computed, self.admitted):
            del held[seq]

    def _done(self):
        return sorted(s for s, toks in self.tokens.items() if self.computed[s] == len(toks))

    # -- rules ----------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(0, 9), max_size=6))
    def add(self, prefix, extra):
        seq, self.next_id = self.next_id, self.next_id + 1
        self._admit(seq, prefix + extra)

    @precondition(lambda self: len(self._done()) < len(self.tokens))
    @rule(data=st.data())
    def prefill_chunk(self, data):
        """The next chunk of a prompt: its sliding blocks are held first, or the pool is short
        and the sequence is preempted (recomputed later)."""
        seq = data.draw(st.sampled_from(sorted(set(self.tokens) - set(self._done()))))
        start = self.computed[seq]
        end = min(len(self.tokens[seq]), start + self.chunk)
        if not self.kv.try_hold(seq, start, end):
            self.kv.preempt(seq, self.tokens[seq], start)
            self._forget(seq)
            return
        self._compute(seq, start, end)

    @precondition(lambda self: self._done())
    @rule(data=st.data(), token=st.integers(0, 9))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self._done()))
        copies = self.kv.try_append(seq, 1)
        if copies is None:
            return
        self._copy(copies)
        self.tokens[seq].append(token)
        n = len(self.tokens[seq])
        self._compute(seq, n - 1, n)

    @precondition(lambda self: self._done())
    @rule(data=st.data(), proposed=st.integers(1, 3))
    def speculate(self, data, proposed):
        """Append draft tokens, compute them, keep some: the table shrinks back."""
        seq = data.draw(st.sampled_from(self._done()))
        proposed = min(proposed, self.chunk or proposed)  # a step's tokens include the drafts
        copies = self.kv.try_append(seq, proposed)
        if copies is None:
            return
        self._copy(copies)
        start = len(self.tokens[seq])
        self.tokens[seq] += [8] * proposed
        self._write(seq, start, start + proposed)
        kept = start + data.draw(st.integers(0, proposed))
        del self.tokens[seq][kept:]
        self.kv.truncate(seq, kept)
        self._step_done(seq)
        self.computed[seq] = kept

    @precondition(lambda self: self._done())
    @rule(data=st.data(), share=st.booleans())
    def fork(self, data, share):
        parent = data.draw(st.sampled_from(self._done()))
        child, self.next_id = self.next_id, self.next_id + 1
        try:
            copies = self.kv.fork(parent, child, share=share)
        except PoolExhaustedError:
            assert child not in self.kv
            return
        self._copy(copies)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child], self.admitted[child] = self.computed[parent], self.admitted[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(seq)
        self._forget(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt_and_readmit(self, data):
        """Recompute preemption, in the middle of a prompt too: the blocks go back, the sequence
        comes back on prefix hits."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[seq]
        self.kv.preempt(seq, toks, self.computed[seq])
        self._forget(seq)
        self._admit(seq, toks)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def refcounts_equal_holders(self):
        holders = Counter()
        for seq in self.tokens:
            holders.update(self.kv.grouped(seq).live_block_ids())
        pool = self.kv.pool
        for block in range(pool.num_blocks):
            expected = 1 if block == self.kv.null_block else holders[block]
            assert pool.refcount(block) == expected, f"block {block}"
        unheld = sum(1 for b in range(pool.num_blocks) if pool.refcount(b) == 0)
        assert pool.num_free_blocks == unheld, "a block leaked"
        assert self.kv.null_block not in pool.free_block_ids() + pool.cached_free_block_ids()

    @invariant()
    def windows_bound_live_blocks(self):
        """A sliding group holds a window's blocks (and the one a boundary adds); allocated by
        chunks, nothing past the next chunk; and never more than ``peak_blocks`` says."""
        for seq, toks in self.tokens.items():
            grouped = self.kv.grouped(seq)
            for table in grouped.tables:
                assert table.num_tokens == len(toks)
                if isinstance(table, WindowedBlockTable):
                    bound = -(-table.window // BLOCK_SIZE) + 1
                    assert len(table.live_block_ids()) <= bound
                    nulls = table.block_ids[: table.num_nulled] + table.block_ids[table.held_end :]
                    assert all(b == self.kv.null_block for b in nulls)
                    if self.chunk is not None:
                        assert table.held_end <= blocks_for(self.computed[seq] + self.chunk, BLOCK_SIZE)
            final = max(len(toks), self.admitted[seq] + 1)
            assert self.kv.held_blocks(seq) <= self.kv.peak_blocks(self.admitted[seq], final)


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_plan_groups_gemma_shapes():
    gemma2 = plan_kv_groups([4096 if i % 2 == 0 else None for i in range(8)])
    assert gemma2.windows == (None, 4096) and gemma2.group_size == 4
    assert sorted(zip(gemma2.layer_group, gemma2.layer_slot, strict=True)) == sorted(
        (g, s) for g in range(2) for s in range(4)
    )
    gemma3 = plan_kv_groups([None if i % 6 == 5 else 1024 for i in range(12)])
    assert gemma3.windows == (None,) + (1024,) * 5 and gemma3.group_size == 2
    assert plan_kv_groups([None, None]) is None
