"""A Hypothesis state machine drives a speculating engine through random request mixes.

Greedy and seeded requests, parallel samples (forks sharing blocks copy-on-write), beam searches
(which never speculate), aborts, prompts over a few tokens (so prompt lookup proposes often) with
a shared prefix (so the prefix cache hits), and a pool small enough to preempt. After every step:
each block's refcount equals its holders; every sequence's table holds slots for its verified
tokens only (rejected proposals rolled back, no block past them); no block the prefix cache holds
contains a token a holder has not verified; the proposer and the policy track only running
sequences. At the end every block is back in the pool.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.memory import blocks_for
from tests.checkpoints import make_checkpoint

SHARED = [20, 21, 22, 20, 21, 22, 23, 24]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(make_checkpoint(tmp_path_factory.mktemp("spec-invariants"), "llama"))


prompts = st.builds(
    lambda shared, tail: (SHARED if shared else []) + tail,
    st.booleans(),
    st.lists(st.integers(20, 26), min_size=1, max_size=10),
)


class SpeculatingEngine(RuleBasedStateMachine):
    checkpoint: str = ""
    #: drafts verified and proposed tokens accepted over every example: speculation really ran
    drafts = accepted = 0

    def __init__(self) -> None:
        super().__init__()
        self.engine = LLM(
            self.checkpoint,
            dtype="float32",
            num_kv_blocks=24,
            block_size=4,
            max_num_batched_tokens=16,
            watermark=0.0,
            decode_headroom=0.0,
            speculative_config=NGRAM,
        ).engine
        self.added: list[str] = []

    def _add(self, add) -> None:
        request_id = str(len(self.added))
        add(request_id)
        self.added.append(request_id)

    @initialize()
    def add_one_that_speculates(self):
        """Every example holds a request whose proposals are accepted (on the test checkpoint
        the greedy continuation of ``[20]`` repeats itself), so the accepting path runs under
        every mix the rules draw, not only when the draws happen to make one."""
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        self._add(lambda rid: self.engine.add_request(rid, [20], params))

    @rule(prompt=prompts, max_tokens=st.integers(1, 12))
    def add_greedy(self, prompt, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self._add(lambda rid: self.engine.add_request(rid, prompt, params))

    @rule(prompt=prompts, max_tokens=st.integers(1, 12), n=st.integers(1, 3), seed=st.integers(0, 9))
    def add_samples(self, prompt, max_tokens, n, seed):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.7, n=n, seed=seed, ignore_eos=True)
        self._add(lambda rid: self.engine.add_request(rid, prompt, params))

    @rule(prompt=prompts, max_tokens=st.integers(1, 5), width=st.integers(1, 3))
    def add_beams(self, prompt, max_tokens, width):
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
        self._add(lambda rid: self.engine.add_beam_request(rid, prompt, params))

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()
            self.check_after_step()

    @precondition(lambda self: self.added)
    @rule(index=st.integers(0, 20))
    def abort(self, index):
        self.engine.abort(self.added[index % len(self.added)])

    @invariant()
    def refcounts_equal_holders(self):
        manager = self.engine.kv_manager
        holders = Counter(b for seq_id in manager.seq_ids() for b in manager.block_ids(seq_id))
        pool = manager.pool
        assert [pool.refcount(b) for b in range(pool.num_blocks)] == [
            holders[b] for b in range(pool.num_blocks)
        ]
        assert set(manager.seq_ids()) == {s.seq_id for s in self.engine.scheduler.running}

    @invariant()
    def the_cache_holds_verified_tokens_only(self):
        manager, bs = self.engine.kv_manager, self.engine.kv_manager.block_size
        cache = manager.pool.prefix_cache
        for seq in self.engine.scheduler.running:
            for i, block in enumerate(manager.block_ids(seq.seq_id)):
                if block in cache:
                    assert (i + 1) * bs <= min(seq.num_computed_tokens, seq.num_tokens)
                    assert cache.token_ids_of(block) == tuple(seq.token_ids[i * bs : (i + 1) * bs])

    def check_after_step(self):
        """No slot or block is held for a token that is not the sequence's (verified) own."""
        manager = self.engine.kv_manager
        for seq in self.engine.scheduler.running:
            table = manager.table(seq.seq_id)
            # A step grows a decoding table by the slot of the token it samples; a beam that has
            # computed everything waits for its siblings before its token is chosen, holding that
            # one slot meanwhile (it never speculates).
            waiting_beam = seq.request.beam is not None and seq.num_computed_tokens == seq.num_tokens
            assert table.num_tokens <= seq.num_tokens + waiting_beam
            assert len(table.block_ids) == blocks_for(table.num_tokens, manager.block_size)
            assert not seq.spec_token_ids or seq.num_computed_tokens == seq.num_tokens - 1
        tracked = self.engine.verifier.speculator._tracked
        assert tracked <= {s.seq_id for s in self.engine.scheduler.running}

    def teardown(self):
        steps = 0
        while self.engine.has_unfinished_requests():
            self.engine.step()
            self.check_after_step()
            steps += 1
            assert steps < 500, "the engine stopped making progress"
        assert self.engine.kv_manager.usage().used_blocks == 0
        assert not self.engine.kv_manager.seq_ids() and not self.engine.scheduler.has_work
        speculator = self.engine.verifier.speculator
        assert not speculator.proposer.num_tracked_sequences
        SpeculatingEngine.drafts += speculator.totals.num_drafts
        SpeculatingEngine.accepted += speculator.totals.num_accepted_tokens


def test_a_speculating_engine_keeps_its_pool_whole(checkpoint):
    SpeculatingEngine.checkpoint = checkpoint
    run = SpeculatingEngine.TestCase
    run.settings = settings(
        max_examples=15,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    run().runTest()
    assert SpeculatingEngine.drafts > 0 and SpeculatingEngine.accepted > 0
