"""Hypothesis drives the pool and its second tier together and checks both after every step.

A shadow executor stands in for the KV tensors: every pool block and every tier slot holds a
record of what was written there (the tokens before it and its own tokens). It performs each
step's moves in the executor's order (outbound, copy-on-write, inbound), then the forward pass's
writes, and acknowledges them -- at once, as the host tier does, or later and possibly failed,
as a disk tier's writes may be. The disk flavour can also tear a file (its loads fail their
check) and crash (writes in flight are lost, the pool and every request with them; a new
manager indexes what the folder holds).

What must hold: every token a sequence counts as computed sits in the right place with the
right history (spills, loads, swaps and copies never lose or mix up a byte); a block hash is in
the pool, in the tier, or in both only where both copies are valid; a spill in flight or a torn
file is never loaded; refcounts equal holders; every pool block and tier slot is accounted for,
and all come back once the requests are gone.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.memory import KVTier, PoolExhaustedError, TieredKVCacheManager, TransferReport
from pagedkv.memory.block_hash import chain_hashes

BS = 2
PREFIXES = [[1, 2, 3, 4, 5], [3, 4, 1, 2], [1, 2, 9], [7, 7, 7, 7, 7, 7]]
#: a block's record: (tokens before it, its tokens with None where nothing was written)
Content = tuple[tuple[int, ...], tuple]


def content_hash(content: Content) -> int | None:
    """The chained hash a full block's record stands for (None: not a full, written block)."""
    prefix, data = content
    if None in data or len(prefix) % BS:
        return None
    tokens = list(prefix) + list(data)
    return chain_hashes(tokens, BS, 0, len(tokens) // BS, None)[-1]


class TieredMemoryMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 8),
        capacity=st.integers(1, 10),
        caching=st.sampled_from([True, True, True, False]),
        disk=st.booleans(),
        mode=st.sampled_from([None, "swap", "recompute"]),
    )
    def setup(self, num_blocks, capacity, caching, disk, mode):
        self.params = (num_blocks, capacity, caching, mode)
        self.disk = disk  # outbound writes are acknowledged later, may fail; files may tear
        self.kv = self._manager()
        self.block: dict[int, Content] = {}  # pool block -> record
        self.slot: dict[int, Content] = {}  # tier slot -> record (the disk tier: swap files)
        self.files: dict[int, Content] = {}  # the disk tier's block files, by hash
        self.torn: set[int] = set()  # hashes whose file fails its check
        self.queue: list[tuple] = []  # the disk writer's queue: deletes and writes, in order
        self.running: dict[int, list] = {}  # seq -> [tokens, computed]
        self.waiting: dict[int, list[int]] = {}  # preempted seq -> tokens
        self.mirror: dict[int, tuple] = {}  # tier events replayed: hash -> (parent, tokens)
        self.next_id = 0
        self.history: list[list[int]] = []  # prompts sent: a later turn sends one again

    def _manager(self) -> TieredKVCacheManager:
        num_blocks, capacity, caching, mode = self.params
        tier = KVTier(capacity, "DISK" if self.disk else "CPU")
        # bytes_per_block 1: the cost model swaps anything with tokens to recompute
        return TieredKVCacheManager(num_blocks, BS, tier, 1, caching, 0.0, preemption_mode=mode)

    # -- the shadow executor --------------------------------------------------------------
    @property
    def inflight(self) -> list[int]:
        """Outbound slots whose writes have not ended."""
        return [item[1] for item in self.queue if item[0] == "write"]

    def _step(self, copies=(), writes=()):
        """Run one step: moves in the executor's order, then the forward pass's writes."""
        transfers = self.kv.take_transfers()
        for name in ("spills", "swap_outs", "loads", "swap_ins"):
            if getattr(transfers, name):
                event(f"step with {name}")
        self.queue += [("delete", digest) for digest in transfers.forgotten]
        for spill in transfers.spills:
            record = self.block[spill.block_id]
            assert content_hash(record) == spill.block_hash, "spilled a block that does not hold its hash"
            assert record[1] == spill.token_ids
        digest_of = {spill.slot: spill.block_hash for spill in transfers.spills}
        for block, slot in transfers.outbound():
            if self.disk:
                self.queue.append(("write", slot, digest_of.get(slot), self.block[block]))
            else:
                self.slot[slot] = self.block[block]
        for src, dst in copies:
            self.block[dst] = self.block[src]
        digest_of = {load.slot: load.block_hash for load in transfers.loads}
        loaded = []
        for slot, block in transfers.inbound():
            assert slot not in self.inflight, "loaded a slot being written"
            record = self._read(slot, digest_of.get(slot))
            if record is not None:
                if slot in digest_of:
                    assert content_hash(record) == digest_of[slot]
                self.block[block] = record
            loaded.append((slot, record is not None))
        stored = [] if self.disk else [(slot, True) for _, slot in transfers.outbound()]
        self.kv.complete(TransferReport(stored=stored, loaded=loaded))
        for seq, cap in self.kv.take_load_failures().items():
            event("a load failed its check")
            if seq in self.running:
                self.running[seq][1] = min(self.running[seq][1], cap)
        for seq, end in writes:
            self._write(seq, end)
        self._replay_events()

    def _read(self, slot, digest):
        """A slot's record (a swap slot, or the host tier), or a block file's; None: the file
        fails its check and nothing is loaded."""
        if digest is None or not self.disk:
            return self.slot[slot]
        if digest in self.torn:
            return None
        return self.files[digest]

    def _write(self, seq, end):
        """The forward pass computes ``seq``'s tokens from its computed count up to ``end``."""
        tokens, start = self.running[seq]
        table = self.kv.table(seq)
        for pos in range(start, end):
            block, offset = table.block_ids[pos // BS], pos % BS
            assert self.kv.pool.refcount(block) == 1, "wrote into a shared block"
            prefix, data = self.block.get(block, ((), (None,) * BS))
            if offset == 0:
                prefix, data = tuple(tokens[:pos]), (None,) * BS
            data = data[:offset] + (tokens[pos],) + data[offset + 1 :]
            self.block[block] = (prefix, data)
        self.running[seq][1] = max(start, end)
        self.kv.cache_computed_blocks(seq, tokens, self.running[seq][1])

    def _replay_events(self):
        for change in self.kv.take_tier_events():
            for digest in change.block_hashes:
                if change.removed:
                    del self.mirror[digest]
                else:
                    assert digest not in self.mirror, "stored twice without a removal"
                    self.mirror[digest] = (change.parent_hash, change.token_ids)

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    # -- rules ----------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=5),
        f=st.floats(0, 1),
        short=st.booleans(),
    )
    def add_request(self, prefix, suffix, f, short):
        self._request(prefix + suffix, f, short)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), more=st.lists(st.integers(0, 3), max_size=3), short=st.booleans())
    def send_again(self, data, more, short):
        """The next turn of a conversation: an earlier prompt, maybe longer."""
        self._request(data.draw(st.sampled_from(self.history)) + more, 1.0, short)

    def _request(self, prompt, f, short):
        """Admit ``prompt`` and compute a fraction ``f`` of it; a ``short`` request then ends."""
        self.history.append(prompt)
        seq = self._new_id()
        before = (self.kv.usage(), self.kv.tier_usage())
        try:
            cached = self.kv.allocate(seq, prompt)
        except PoolExhaustedError:
            assert (self.kv.usage(), self.kv.tier_usage()) == before and seq not in self.kv
            return
        assert cached % BS == 0 and cached < len(prompt)
        self.running[seq] = [list(prompt), cached]
        self._step(writes=[(seq, max(cached, int(f * len(prompt))))])
        if short:
            self.kv.free(seq)
            del self.running[seq]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.running)))
        tokens, computed = self.running[seq]
        if computed < len(tokens):  # finish the prompt first
            self._step(writes=[(seq, len(tokens))])
        copies = self.kv.try_append(seq, 1)
        if copies is None:
            return
        tokens.append(token)
        self._step(copies=copies, writes=[(seq, len(tokens))])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode_then_preempt(self, data, token):
        """A decode's copy-on-write copy and a preemption in one step (the victim may be the
        sequence whose copy is pending)."""
        seq = data.draw(st.sampled_from(sorted(self.running)))
        tokens, computed = self.running[seq]
        copies = self.kv.try_append(seq, 1) if computed == len(tokens) else None
        if copies is not None:
            tokens.append(token)
        victim = data.draw(st.sampled_from(sorted(self.running)))
        self._preempt(victim)
        writes = [(seq, len(tokens))] if copies is not None and seq in self.running else []
        self._step(copies=copies or (), writes=writes)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.running)))
        if self.running[parent][1] < len(self.running[parent][0]):  # samples come after the prompt
            self._step(writes=[(parent, len(self.running[parent][0]))])
        child = self._new_id()
        self.kv.fork(parent, child)
        tokens, computed = self.running[parent]
        self.running[child] = [list(tokens), computed]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.running)))
        self.kv.free(seq)
        del self.running[seq]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(data.draw(st.sampled_from(sorted(self.running))))
        self._step()

    def _preempt(self, seq):
        tokens, computed = self.running.pop(seq)
        kept = min(computed, len(tokens) - 1)  # the engine never counts the last token computed
        outcome = self.kv.preempt(seq, tokens, kept)
        assert outcome.tokens_kept == (kept if outcome.swapped else 0)
        assert self.kv.is_swapped(seq) == outcome.swapped
        self.waiting[seq] = tokens

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data):
        seq = data.draw(st.sampled_from(sorted(self.waiting)))
        if not self.kv.swap_ready(seq):
            return  # its swap-out is still being written
        tokens = self.waiting[seq]
        try:
            cached = self.kv.allocate(seq, tokens)
        except PoolExhaustedError:
            return
        assert cached < len(tokens)
        event(f"readmitted, swap fallbacks so far: {min(self.kv.swap_fallbacks, 1)}")
        del self.waiting[seq]
        self.running[seq] = [tokens, cached]
        self._step(writes=[(seq, len(tokens))])

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        seq = data.draw(st.sampled_from(sorted(self.waiting)))
        self.kv.free(seq)
        del self.waiting[seq]

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def disk_writer_runs(self, data):
        """The disk writer works through the first items of its queue, in order; a write may
        fail (a full disk)."""
        count = data.draw(st.integers(1, len(self.queue)))
        self._run_writer(count, lambda: data.draw(st.booleans()) or data.draw(st.booleans()))

    def _run_writer(self, count, succeeds):
        done, self.queue = self.queue[:count], self.queue[count:]
        stored = []
        for item in done:
            if item[0] == "delete":
                self.files.pop(item[1], None)
                self.torn.discard(item[1])
                continue
            _, slot, digest, record = item
            ok = succeeds()
            if ok and digest is None:
                self.slot[slot] = record
            elif ok:
                self.files[digest] = record
                self.torn.discard(digest)
            stored.append((slot, ok))
        self.kv.complete(TransferReport(stored=stored))
        self._replay_events()

    @precondition(lambda self: self.disk and self.kv.tier.readable_blocks())
    @rule(data=st.data())
    def tear_a_file(self, data):
        """A file of the disk tier is damaged; then a request wants exactly that prefix."""
        entry = data.draw(st.sampled_from(self.kv.tier.readable_blocks()))
        self.torn.add(entry.block_hash)
        prefix, tokens = self.files[entry.block_hash]
        self._request([*prefix, *tokens, 0], 1.0, True)

    @rule()
    def reset_cache(self):
        self.kv.reset_prefix_cache()
        self._replay_events()

    @rule()
    def spill_the_cache(self):
        """A disk tier's engine stopping: every pool-cached block the tier lacks is written
        out (held ones too: a cached block is full and immutable), oldest first."""
        planned = self.kv.spill_cached()
        event(f"spilled the cache, {'some' if planned else 'no'} block(s) planned")
        self._step()

    @precondition(lambda self: self.disk and self.files)
    @rule()
    def crash_and_restart(self):
        """Writes in flight are lost; a new manager indexes the files that pass their check."""
        intact = {digest: record for digest, record in self.files.items() if digest not in self.torn}
        self.kv = self._manager()
        self.running, self.waiting, self.queue, self.mirror = {}, {}, [], {}
        self.block, self.slot, self.files, self.torn = {}, {}, intact, set()
        event(f"restart, {'some' if len(intact) > 1 else 'one or no'} file(s) to index")
        found = []
        for digest, (prefix, tokens) in intact.items():
            parent = chain_hashes(list(prefix), BS, 0, len(prefix) // BS, None)[-1] if prefix else None
            found.append((digest, parent, tokens))
        slots = self.kv.restore(found)
        assert len(slots) == min(len(found), self.kv.tier.capacity)
        for digest in set(intact) - set(slots):  # past the capacity: the executor deletes them
            del self.files[digest]
        self._replay_events()

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def computed_tokens_are_in_place(self):
        for seq, (tokens, computed) in self.running.items():
            table = self.kv.table(seq)
            assert table.num_tokens == len(tokens)
            for pos in range(computed):
                prefix, data = self.block[table.block_ids[pos // BS]]
                assert prefix == tuple(tokens[: pos - pos % BS]), f"seq {seq} block history wrong at {pos}"
                assert data[pos % BS] == tokens[pos], f"seq {seq} token {pos} wrong"

    @invariant()
    def every_copy_of_a_hash_is_valid(self):
        """Pool-cached blocks and readable tier blocks (the two places a hash lives) hold it."""
        cache = self.kv.pool.prefix_cache
        for block in cache.blocks():
            assert content_hash(self.block[block]) == cache.hash_of(block)
        for entry in self.kv.tier.readable_blocks():
            record = self.files[entry.block_hash] if self.disk else self.slot[entry.slot]
            assert content_hash(record) == entry.block_hash

    @invariant()
    def refcounts_equal_holders(self):
        holders = Counter(b for seq in self.running for b in self.kv.block_ids(seq))
        for block in range(self.kv.num_blocks):
            assert self.kv.pool.refcount(block) == holders.get(block, 0)
        assert set(self.kv.seq_ids()) == set(self.running)

    @invariant()
    def every_block_and_slot_is_accounted_for(self):
        pool = self.kv.pool
        free, cached_free = pool.free_block_ids(), pool.cached_free_block_ids()
        in_use = [b for b in range(pool.num_blocks) if pool.refcount(b) > 0]
        assert sorted(free + cached_free + in_use) == list(range(pool.num_blocks))
        tier = self.kv.tier
        owners = tier.slot_owners()
        assert len(owners) + tier.num_free_slots == tier.capacity
        assert not set(owners) & set(tier.free_slots())
        assert {key[0] for kind, key in owners.values() if kind == "swap"} <= set(self.waiting)
        waiting_for_writes = {slot for slot, (kind, _) in owners.items() if kind in ("dropped", "released")}
        assert waiting_for_writes <= set(self.inflight)  # inbound moves end within their step

    @invariant()
    def events_rebuild_the_tier(self):
        readable = {e.block_hash: (e.parent_hash, e.token_ids) for e in self.kv.tier.readable_blocks()}
        assert self.mirror == readable

    def teardown(self):
        for seq in list(self.running) + list(self.waiting):
            self.kv.free(seq)
        self._run_writer(len(self.queue), lambda: True)
        assert self.kv.transfers_in_flight() == 0
        self.every_copy_of_a_hash_is_valid()  # every readable block still has its file
        assert self.kv.usage().free_blocks == self.kv.num_blocks
        tier = self.kv.tier
        assert tier.num_swap_slots == 0 and all(not e.busy for e in tier.readable_blocks())
        assert tier.num_free_slots + tier.num_blocks == tier.capacity


TestTieredMemoryInvariants = TieredMemoryMachine.TestCase
TestTieredMemoryInvariants.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
