"""Whatever path a sequence takes through its grammar, the text it ends with is what was asked for.

Each walk draws every token uniformly among those the grammar allows next (the widest sampler
there is: any real sampler picks among a subset) with the built-in model's real tokenizer,
until the matcher accepts a stop token. The specs have finite languages, so every walk ends.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedkv.engine.structured import StructuredOutputsParams
from tests.engine.structured.walks import next_allowed, random_walk

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "active": {"type": "boolean"},
        "note": {"type": "string", "pattern": "^.{1,6}$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,6}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "active"],
    "additionalProperties": False,
}

REGEX = r"[a-z]{1,8}@[a-z]{1,6}\.(com|org|net)|(yes|no|maybe)-[0-9]{2,4}"

CHOICES = ["positive", "négatif", 'say "hi"', "a\\b", "new\nline", "positive!"]

EBNF = r"""root ::= item ("," item){0,3}
item ::= "true" | "false" | [0-9]{1,3} | "[" [a-c]{0,2} "]"
"""
EBNF_LANGUAGE = re.compile(
    r"(true|false|[0-9]{1,3}|\[[a-c]{0,2}\])(,(true|false|[0-9]{1,3}|\[[a-c]{0,2}\])){0,3}"
)

LARK = r"""start: greeting " " NAME
greeting: "hello" | "goodbye"
NAME: /[A-Z][a-z]{1,5}/
"""
LARK_LANGUAGE = re.compile(r"(hello|goodbye) [A-Z][a-z]{1,5}")

SEEDS = st.integers(min_value=0, max_value=2**32 - 1)


def walk_text(compiler, tokenizer, vocab_size, params: StructuredOutputsParams, seed: int) -> str:
    tokens = random_walk(compiler.compile(params).matcher(), vocab_size, seed)
    assert tokens[-1] in tokenizer.eos_token_ids  # it ended by accepting a stop token
    assert not set(tokens[:-1]) & tokenizer.eos_token_ids
    return tokenizer.decode(tokens[:-1])


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS)
@example(seed=20075)  # spelled a surrogate (ED A6 84) in "name": 14 characters once decoded
def test_a_json_schema_walk_always_ends_in_json_the_schema_validates(compiler, tokenizer, vocab_size, seed):
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    text = walk_text(compiler, tokenizer, vocab_size, params, seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS)
def test_a_regex_walk_always_ends_in_a_full_match(compiler, tokenizer, vocab_size, seed):
    text = walk_text(compiler, tokenizer, vocab_size, StructuredOutputsParams(regex=REGEX), seed)
    assert re.fullmatch(REGEX, text), text


@settings(max_examples=40, deadline=None)
@given(seed=SEEDS)
def test_a_choice_walk_always_ends_in_one_of_the_choices(compiler, tokenizer, vocab_size, seed):
    text = walk_text(compiler, tokenizer, vocab_size, StructuredOutputsParams(choice=CHOICES), seed)
    assert text in CHOICES


def test_choice_walks_reach_every_choice(compiler, tokenizer, vocab_size):
    """The mask forbids what is not a choice, and nothing that is: a choice that is a prefix of
    another ("positive" of "positive!") stays reachable."""
    params = StructuredOutputsParams(choice=CHOICES)
    texts = {walk_text(compiler, tokenizer, vocab_size, params, seed) for seed in range(300)}
    assert texts == set(CHOICES)


@pytest.mark.parametrize(
    ("grammar", "language"), [(EBNF, EBNF_LANGUAGE), (LARK, LARK_LANGUAGE)], ids=["ebnf", "lark"]
)
@settings(max_examples=30, deadline=None)
@given(seed=SEEDS)
def test_a_grammar_walk_always_ends_in_a_sentence_of_the_grammar(
    compiler, tokenizer, vocab_size, grammar, language, seed
):
    text = walk_text(compiler, tokenizer, vocab_size, StructuredOutputsParams(grammar=grammar), seed)
    assert language.fullmatch(text), text


def test_no_json_string_admits_a_raw_control_character(compiler, tokenizer, vocab_size):
    """JSON strings escape U+0000..U+001F; xgrammar's length-bounded strings let them through
    unless the backend corrects the grammar, and a walk would then end in text json.loads refuses."""
    control = {t for t in range(vocab_size) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))}
    assert control  # the byte-level vocabulary has them
    schemas = [{"type": "string", "maxLength": 5}, {"type": "string", "minLength": 2}, {"type": "string"}]
    for schema in schemas:
        matcher = compiler.compile(
            StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        ).matcher()
        assert matcher.accept_token(tokenizer.encode('"', add_special_tokens=False)[0])
        assert not control & set(next_allowed(matcher, vocab_size)), schema


def test_without_whitespace_json_keeps_to_single_spaces(compiler, tokenizer, vocab_size):
    """``disable_any_whitespace``: no newline, no run of spaces, outside strings or inside."""
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for seed in range(20):
        text = walk_text(compiler, tokenizer, vocab_size, params, seed)
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', text)
        assert "\n" not in outside_strings and "  " not in outside_strings, text
