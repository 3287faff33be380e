"""No grammar walks a byte-level vocabulary into invalid UTF-8 (surrogates, overlong forms)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.engine.structured.utf8_guard import NARROW_LEADS, valid_inside
from tests.engine.structured.walks import next_allowed, random_walk

#: Wide classes that accept invalid UTF-8 in xgrammar: a bounded and an unbounded JSON string,
#: a pattern inside a schema, a regex's ".", an EBNF negated class.
SPECS = [
    StructuredOutputsParams(json={"type": "string", "maxLength": 12}),
    StructuredOutputsParams(json={"type": "string"}),
    StructuredOutputsParams(json={"type": "string", "pattern": "^.{1,6}$"}),
    StructuredOutputsParams(regex=".{1,8}"),
    StructuredOutputsParams(grammar='root ::= [^"]{1,8}'),
]
IDS = ["json-bounded", "json-string", "json-pattern", "regex-dot", "ebnf-negated"]


@pytest.fixture(scope="module")
def token_bytes(compiler, tokenizer, vocab_size) -> list[bytes]:
    """Each token's bytes, as the grammar library reads them."""
    import xgrammar
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast

    wrapper = PreTrainedTokenizerFast(tokenizer_object=BackendTokenizer.from_str(tokenizer.backend.to_str()))
    return xgrammar.TokenizerInfo.from_huggingface(
        wrapper, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids)
    ).decoded_vocab


def test_what_counts_as_valid_inside_a_token():
    assert valid_inside("a\u20ac\U0001f600".encode())
    assert valid_inside(bytes([0x82, 0xAC, 0x61]))  # continuation bytes first: they end the last character
    assert valid_inside(bytes([0x61, 0xE2, 0x82]))  # ends mid-character
    assert not valid_inside(bytes([0x61, 0xED, 0xA0, 0x80]))  # a surrogate
    assert not valid_inside(bytes([0xE0, 0x80]))  # an overlong form
    assert not valid_inside(bytes([0xF4, 0x90]))  # past U+10FFFF
    assert not valid_inside(bytes([0xC0]))  # never a lead byte
    assert valid_inside(bytes([0xED, 0x9F, 0xBF]))  # U+D7FF, the last before the surrogates


@pytest.mark.parametrize("lead", sorted(NARROW_LEADS))
@pytest.mark.parametrize("params", SPECS, ids=IDS)
def test_after_a_narrowing_lead_byte_only_the_bytes_it_allows_may_follow(
    compiler, token_bytes, vocab_size, params, lead
):
    lead_token = token_bytes.index(bytes([lead]))
    wrong = [
        t
        for t, data in enumerate(token_bytes)
        if data and 0x80 <= data[0] < 0xC0 and data[0] not in NARROW_LEADS[lead]
    ]
    invalid = [t for t, data in enumerate(token_bytes) if not valid_inside(data)]
    assert wrong and invalid  # the byte-level vocabulary has them
    matcher = compiler.compile(params).matcher()
    if params.kind == "json":
        assert matcher.accept_token(token_bytes.index(b'"'))
    assert not set(next_allowed(matcher, vocab_size)) & set(invalid)
    assert matcher.accept_token(lead_token)
    allowed = set(next_allowed(matcher, vocab_size))
    assert allowed, "the bytes the lead allows stay allowed"
    assert not allowed & set(wrong)
    assert not matcher.accept_token(wrong[0])
    assert matcher.accepted_tokens[-1] == lead_token


@pytest.mark.parametrize("params", SPECS, ids=IDS)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_every_walk_decodes_as_strict_utf8(compiler, token_bytes, vocab_size, params, seed):
    tokens = random_walk(compiler.compile(params).matcher(), vocab_size, seed)
    b"".join(token_bytes[t] for t in tokens[:-1]).decode("utf-8")  # raises on invalid UTF-8
