"""No grammar walks a byte-level vocabulary into invalid UTF-8 (a UTF-16 surrogate's spelling)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.engine.structured.utf8_guard import SURROGATE_LEAD, SURROGATE_SECOND, spells_surrogate
from tests.engine.structured.walks import next_allowed, random_walk

#: Wide classes that span the surrogates in xgrammar: a bounded and an unbounded JSON string,
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


def test_the_spelling_rule():
    assert spells_surrogate(bytes([0x61, SURROGATE_LEAD, 0xA0, 0x80]))
    assert spells_surrogate(bytes([SURROGATE_LEAD, 0xBF]))
    assert not spells_surrogate("\ud7ff\ue000 \u20ac".encode("utf-8", "surrogatepass"))
    assert not spells_surrogate(bytes([SURROGATE_LEAD, 0x9F, 0xBF]))  # U+D7FF, the last before them


@pytest.mark.parametrize("params", SPECS, ids=IDS)
def test_after_a_lead_byte_no_surrogate_second_byte_is_allowed_or_accepted(
    compiler, token_bytes, vocab_size, params
):
    lead = token_bytes.index(bytes([SURROGATE_LEAD]))
    seconds = [t for t, data in enumerate(token_bytes) if data and data[0] in SURROGATE_SECOND]
    inside = [t for t, data in enumerate(token_bytes) if spells_surrogate(data)]
    assert seconds  # the byte-level vocabulary has them
    matcher = compiler.compile(params).matcher()
    if params.kind == "json":
        assert matcher.accept_token(token_bytes.index(b'"'))
    assert not set(next_allowed(matcher, vocab_size)) & set(inside)
    assert matcher.accept_token(lead)  # a lead byte is fine: U+D000..U+D7FF start with it
    allowed = set(next_allowed(matcher, vocab_size))
    assert allowed, "the lead byte's other continuations (80..9F) stay allowed"
    assert not allowed & set(seconds)
    assert not matcher.accept_token(seconds[0])
    assert matcher.accepted_tokens[-1] == lead


@pytest.mark.parametrize("params", SPECS, ids=IDS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_every_walk_decodes_as_strict_utf8(compiler, token_bytes, vocab_size, params, seed):
    tokens = random_walk(compiler.compile(params).matcher(), vocab_size, seed)
    b"".join(token_bytes[t] for t in tokens[:-1]).decode("utf-8")  # raises on a surrogate
