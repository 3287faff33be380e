"""PromptEncoder's bound and early stop against the real tokenizer: they never change an answer.

Stage 1 (the bound from a text's length) and stage 2's early stop only refuse sooner: whatever
texts, ``max_tokens``, truncation and budget, ``encode_prompts`` returns exactly the tokenizer's
ids when every prompt fits and the batch is within its budget, and refuses otherwise.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine import InvalidRequestError
from pagedkv.models import builtin_model_path
from pagedkv.server.prompts import PromptEncoder, PromptLimits
from pagedkv.tokenizer import load_tokenizer

CONTEXT = 64
#: Text the tokenizer takes: any character but a lone surrogate, runs of one character included
#: (they are where a BPE token covers the most characters).
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=400),
    st.builds(lambda c, k: c * k, st.sampled_from(" x\n-#é"), st.integers(1, 3000)),
)


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder(load_tokenizer(builtin_model_path()), CONTEXT)


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_the_bound_never_exceeds_the_tokens(encoder, text):
    assert encoder.chars_per_token is not None  # the built-in BPE has a bound
    assert encoder.min_tokens(text) <= len(encoder.tokenizer.encode(text, add_special_tokens=False))


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(TEXT, min_size=1, max_size=4),
    max_tokens=st.integers(1, CONTEXT + 8),
    truncate_to=st.one_of(st.none(), st.integers(1, CONTEXT)),
    n=st.integers(1, 3),
    budget=st.integers(1, 4 * CONTEXT),
)
def test_encode_prompts_refuses_exactly_what_does_not_fit(encoder, texts, max_tokens, truncate_to, n, budget):
    limits = PromptLimits(CONTEXT, max_tokens, n, budget, truncate_to=truncate_to)
    exact = [encoder.tokenizer.encode(text) for text in texts]
    if truncate_to is not None:
        exact = [ids[-truncate_to:] for ids in exact]
    fits = all(len(ids) + max_tokens <= CONTEXT for ids in exact)
    # (one sequence is left to the engine's checks: whether it can fit at all comes first there)
    within = n * sum(len(ids) + max_tokens for ids in exact) <= budget or n * len(texts) == 1
    if fits and within:
        assert encoder.encode_prompts(texts, limits) == exact
    else:
        with pytest.raises(InvalidRequestError):
            encoder.encode_prompts(texts, limits)


def test_token_id_prompts_pass_through_truncated(encoder):
    limits = PromptLimits(CONTEXT, 4, 1, 1 << 18, truncate_to=3)
    assert encoder.encode_prompts([[5, 6, 7, 8, 9], [10]], limits) == [[7, 8, 9], [10]]
    with pytest.raises(InvalidRequestError, match="prompt 1: .*maximum context length is 64"):
        encoder.encode_prompts([[5], list(range(5, 70))], PromptLimits(CONTEXT, 4, 1, 1 << 18))
