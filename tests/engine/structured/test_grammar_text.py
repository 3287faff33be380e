"""What the backend does to a grammar's text: JSON's whitespace (bounded by default, any, none or
a client's pattern), llama.cpp's GBNF, and constraints no text can complete."""

from __future__ import annotations

import json
import re

import pytest

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.engine.structured.config import StructuredOutputsConfig
from pagedkv.engine.validation import InvalidRequestError
from tests.engine.structured.walks import next_allowed, random_walk

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
#: llama.cpp's grammars/json.gbnf, as llama.cpp ships it (empty alternative included).
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""
#: llama.cpp's JSON whitespace, as a client's pattern: nothing, " ", or "\n" and an indent.
LLAMA_CPP_WHITESPACE = r"( |\n[ \t]{0,20})?"


def _writes(grammar, tokenizer, text: str) -> bool:
    """Whether the grammar lets a model write ``text`` and stop there."""
    matcher = grammar.matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(min(tokenizer.eos_token_ids))


def _whitespace_runs(text: str) -> list[str]:
    outside = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return re.findall(r"[ \t\r\n]+", outside)


def test_json_whitespace_is_one_space_at_most_by_default(compiler, tokenizer, vocab_size):
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    for layout in ('{"city":"Oslo","days":[1,2]}', '{ "city" : "Oslo", "days": [1, 2] }'):
        assert _writes(grammar, tokenizer, layout)
    assert not _writes(grammar, tokenizer, json.dumps({"city": "Oslo", "days": [1, 2]}, indent=2))
    assert not _writes(grammar, tokenizer, '{"city":  "Oslo", "days": []}')  # two spaces
    for seed in range(20):  # a walk at random through the grammar ends, in JSON
        text = tokenizer.decode(random_walk(grammar.matcher(), vocab_size, seed)[:-1])
        assert json.loads(text)["city"] is not None
        assert all(run == " " for run in _whitespace_runs(text)), text


def test_llama_cpp_whitespace_is_a_pattern_away(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA, whitespace_pattern=LLAMA_CPP_WHITESPACE))
    assert _writes(grammar, tokenizer, json.dumps({"city": "Oslo", "days": [1, 2]}, indent=4))
    assert not _writes(grammar, tokenizer, '{\n\n"city": "Oslo", "days": []}')  # two newlines
    assert not _writes(grammar, tokenizer, '{"city": "Oslo",\n' + " " * 21 + '"days": []}')


def test_any_whitespace_and_no_whitespace_are_there_to_choose(make_compiler, tokenizer):
    loose = make_compiler(StructuredOutputsConfig(any_whitespace=True))
    grammar = loose.compile(StructuredOutputsParams(json=SCHEMA))
    assert _writes(grammar, tokenizer, '{\n\n"city":   "Oslo", "days": []}')
    tight = loose.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert _writes(tight, tokenizer, '{"city": "Oslo", "days": []}')
    assert not _writes(tight, tokenizer, '{"city":"Oslo","days":[]}')
    server_wide = make_compiler(StructuredOutputsConfig(disable_any_whitespace=True, any_whitespace=True))
    assert not _writes(
        server_wide.compile(StructuredOutputsParams(json=SCHEMA)), tokenizer, '{ "city": "", "days": []}'
    )


def test_a_whitespace_pattern_spaces_json_between_every_two_tokens(compiler, tokenizer, vocab_size):
    params = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?")
    grammar = compiler.compile(params)
    assert _writes(grammar, tokenizer, '{ "city" : "Oslo" , "days" : [ 1 ] }')
    assert _writes(grammar, tokenizer, '{"city":"Oslo","days":[]}')
    assert not _writes(grammar, tokenizer, '{\n"city": "Oslo", "days": []}')
    for seed in range(10):
        text = tokenizer.decode(random_walk(grammar.matcher(), vocab_size, seed)[:-1])
        assert json.loads(text) and all(run == " " for run in _whitespace_runs(text)), text


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [("[ a]*", "matches more than whitespace"), ("( ", "is not a regex xgrammar reads"), (".", "more than")],
)
def test_a_whitespace_pattern_that_is_not_whitespace_is_refused(compiler, pattern, reason):
    with pytest.raises(InvalidRequestError, match=re.escape(reason)) as refused:
        compiler.compile(StructuredOutputsParams(json=SCHEMA, whitespace_pattern=pattern))
    assert refused.value.param == "structured_outputs.whitespace_pattern"


def test_a_whitespace_pattern_needs_json_and_no_other_spacing():
    with pytest.raises(ValueError, match="needs json or json_object, not regex"):
        StructuredOutputsParams(regex="a+", whitespace_pattern=" ?")
    with pytest.raises(ValueError, match="cannot be combined with disable_any_whitespace"):
        StructuredOutputsParams(json_object=True, whitespace_pattern=" ?", disable_any_whitespace=True)
    assert StructuredOutputsParams(json_object=True, whitespace_pattern=" ?").key() == (
        "json_object",
        "",
        "pattern: ?",
    )


def test_llama_cpp_gbnf_compiles_and_walks_end_in_json(compiler, tokenizer, vocab_size):
    grammar = compiler.compile(StructuredOutputsParams(grammar=JSON_GBNF))
    for seed in range(10):
        text = tokenizer.decode(random_walk(grammar.matcher(), vocab_size, seed, max_steps=20000)[:-1])
        assert isinstance(json.loads(text), dict), text
    anything = compiler.compile(StructuredOutputsParams(grammar='root ::= "<" . ">"'))  # "." is any character
    assert _writes(anything, tokenizer, "<é>") and not _writes(anything, tokenizer, "<ab>")


def test_gbnf_token_references_are_refused_naming_the_field(compiler):
    with pytest.raises(InvalidRequestError, match="Unexpected character: <") as refused:
        compiler.compile(StructuredOutputsParams(grammar='root ::= <[1000]> "a"'))
    assert refused.value.param == "structured_outputs.grammar"


UNSATISFIABLE = {
    "regex": StructuredOutputsParams(regex=r"[^\s\S]"),
    "grammar": StructuredOutputsParams(grammar=r"root ::= [^\x00-\U0010FFFF]"),
    "grammar, endless": StructuredOutputsParams(grammar='root ::= "a" root'),
    "schema pattern": StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": r"[^\s\S]"}},
            "required": ["code"],
        }
    ),
}


@pytest.mark.parametrize("case", list(UNSATISFIABLE))
def test_a_constraint_no_text_completes_is_refused_when_it_compiles(compiler, case):
    params = UNSATISFIABLE[case]
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(params)
    field = f"structured_outputs.{params.kind}"
    assert str(refused.value) == f"{field} is not valid: nothing matches it: no output can ever complete it"
    assert refused.value.param == field


def test_an_unsatisfiable_constraint_would_dead_end_the_first_step(tokenizer, vocab_size):
    """Why it must be refused: xgrammar compiles it, and its first mask allows no token at all --
    the sampler would draw from a row of -inf and the grammar refuse what it drew."""
    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar, XgrammarBackend

    backend = XgrammarBackend(tokenizer.backend, vocab_size, tokenizer.eos_token_ids)
    compiled = backend._compiler.compile_regex(r"[^\s\S]")
    assert next_allowed(CompiledGrammar(("regex", "", ""), compiled, 0.0).matcher(), vocab_size) == []


def test_constraints_that_can_complete_are_kept(compiler):
    kept = [
        StructuredOutputsParams(regex=r"[^a]"),
        StructuredOutputsParams(grammar='root ::= "a" root | "b"'),
        StructuredOutputsParams(  # the property with the empty pattern can be left out
            json={"type": "object", "properties": {"code": {"type": "string", "pattern": r"[^\s\S]"}}}
        ),
    ]
    for params in kept:
        assert compiler.compile(params) is not None
