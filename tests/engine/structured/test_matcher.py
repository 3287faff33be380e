"""A sequence's grammar state: forks are independent, rollbacks exact, refusals change nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.structured import StructuredOutputsParams
from tests.engine.structured.test_walks import EBNF, REGEX, SCHEMA
from tests.engine.structured.walks import next_allowed, random_walk

SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "grammar": StructuredOutputsParams(grammar=EBNF),
}


def state(matcher, vocab_size):
    """Everything observable about a matcher: its tokens, whether it ended, what may come next."""
    terminated = matcher.is_terminated()
    return matcher.accepted_tokens, terminated, None if terminated else next_allowed(matcher, vocab_size)


def replayed(compiled, tokens):
    matcher = compiled.matcher()
    for token in tokens:
        assert matcher.accept_token(token)
    return matcher


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(SPECS)), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_rollback_then_reaccept_is_as_if_never_rolled_back(compiler, vocab_size, kind, seed, data):
    compiled = compiler.compile(SPECS[kind])
    walk = random_walk(compiled.matcher(), vocab_size, seed)
    done = data.draw(st.integers(0, len(walk)), label="tokens accepted")
    back = data.draw(st.integers(0, done), label="tokens rolled back")
    matcher = replayed(compiled, walk[:done])
    matcher.rollback(back)
    assert state(matcher, vocab_size) == state(replayed(compiled, walk[: done - back]), vocab_size)
    for token in walk[done - back : done]:
        assert matcher.accept_token(token)
    assert state(matcher, vocab_size) == state(replayed(compiled, walk[:done]), vocab_size)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(sorted(SPECS)), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_a_fork_and_its_parent_move_independently(compiler, vocab_size, kind, seed, data):
    compiled = compiler.compile(SPECS[kind])
    walk = random_walk(compiled.matcher(), vocab_size, seed)
    shared = data.draw(st.integers(0, len(walk) - 1), label="tokens before the fork")
    parent = replayed(compiled, walk[:shared])
    child = parent.fork()
    assert state(child, vocab_size) == state(parent, vocab_size)
    child_walk = random_walk(child, vocab_size, seed + 1)  # the child walks its own path to the end
    assert child_walk[:shared] == walk[:shared]
    assert state(parent, vocab_size) == state(replayed(compiled, walk[:shared]), vocab_size)
    for token in walk[shared:]:  # then the parent walks on to its end
        assert parent.accept_token(token)
    assert state(parent, vocab_size) == state(replayed(compiled, walk), vocab_size)
    assert state(child, vocab_size) == state(replayed(compiled, child_walk), vocab_size)


def test_a_refused_token_changes_nothing(compiler, tokenizer, vocab_size):
    matcher = compiler.compile(StructuredOutputsParams(regex="(yes|no)-[0-9]{2}")).matcher()
    assert matcher.accept_token(tokenizer.encode("yes", add_special_tokens=False)[0])
    before = state(matcher, vocab_size)
    refused = [t for t in range(vocab_size) if t not in before[2]]
    assert refused
    for token in refused[:: max(1, len(refused) // 50)]:
        assert not matcher.accept_token(token)
    assert state(matcher, vocab_size) == before


def test_a_terminated_matcher_accepts_nothing_until_its_stop_token_is_rolled_back(
    compiler, tokenizer, vocab_size
):
    compiled = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    matcher = compiled.matcher()
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept_token(token)
    assert set(next_allowed(matcher, vocab_size)) == tokenizer.eos_token_ids  # complete: only stops
    stop = min(tokenizer.eos_token_ids)
    assert matcher.accept_token(stop) and matcher.is_terminated()
    assert not matcher.accept_token(stop)
    with pytest.raises(ValueError, match="terminated"):
        next_allowed(matcher, vocab_size)
    matcher.rollback(1)
    assert not matcher.is_terminated()
    assert set(next_allowed(matcher, vocab_size)) == tokenizer.eos_token_ids


def test_rolling_back_more_than_was_accepted_is_refused_and_changes_nothing(compiler, vocab_size):
    matcher = compiler.compile(StructuredOutputsParams(regex=REGEX)).matcher()
    walk = random_walk(compiler.compile(StructuredOutputsParams(regex=REGEX)).matcher(), vocab_size, 7)
    for token in walk[:3]:
        assert matcher.accept_token(token)
    before = state(matcher, vocab_size)
    with pytest.raises(ValueError, match="cannot roll back 4 tokens: the matcher has accepted 3"):
        matcher.rollback(4)
    with pytest.raises(ValueError, match="cannot roll back -1"):
        matcher.rollback(-1)
    assert state(matcher, vocab_size) == before
