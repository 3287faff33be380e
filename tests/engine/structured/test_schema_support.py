"""JSON schema keywords: those xgrammar does not enforce are refused by name, the others are kept.

Each refused case shows why, on the real grammar: the grammar xgrammar compiles for the schema
(the backend, below the compiler's check) lets a model write, token by token to a stop token, a
value the schema refuses -- and the compiler refuses the schema naming the keyword and where it
sits. Each kept case shows the grammar refuses such a value, and that random walks through it
end in values ``jsonschema`` validates.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.engine.structured.schema_support import unsupported_keyword
from pagedkv.engine.validation import InvalidRequestError
from tests.engine.structured.walks import random_walk

INT = {"type": "integer"}
OBJECT_AB = {"type": "object", "properties": {"a": INT, "b": INT}}

#: (schema, a value it refuses that xgrammar's grammar allows, keyword, where)
REFUSED = {
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, [1, 1], "uniqueItems", ""),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 5}}, [1], "contains", ""),
    "not": ({"type": "integer", "not": {"const": 3}}, 3, "not", ""),
    "if/then": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, 9, "if", ""),
    "dependentRequired": (
        {**OBJECT_AB, "dependentRequired": {"a": ["b"]}},
        {"a": 1},
        "dependentRequired",
        "",
    ),
    "dependentSchemas": (
        {**OBJECT_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        {"a": 1},
        "dependentSchemas",
        "",
    ),
    "allOf, two entries": ({"allOf": [{"type": "string"}, INT]}, "a", "allOf", ""),
    "allOf, satisfiable": ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, 9, "allOf", ""),
    "oneOf, overlapping": ({"oneOf": [INT, {"type": "integer", "minimum": 3}]}, 5, "oneOf", ""),
    "multipleOf of a number": ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf", ""),
    "multipleOf not an integer": ({"type": "integer", "multipleOf": 2.5}, 3, "multipleOf", ""),
    "minimum without a type": ({"minimum": 3}, 1, "minimum", ""),
    "maxLength without a type": ({"maxLength": 1}, "abc", "maxLength", ""),
    "minItems without a type": ({"minItems": 2}, [1], "minItems", ""),
    "maxProperties without a type": ({"maxProperties": 1}, {"a": 1, "b": 2}, "maxProperties", ""),
    "required, not a property": ({**OBJECT_AB, "required": ["c"]}, {"a": 1}, "required", ""),
    "a bound beside $ref": ({"$defs": {"x": INT}, "$ref": "#/$defs/x", "minimum": 3}, 1, "minimum", ""),
    "enum against its type": ({"type": "string", "enum": ["a", 1]}, 1, "enum", ""),
    "nested in properties": (
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": INT, "uniqueItems": True}},
            "required": ["tags"],
        },
        {"tags": [1, 1]},
        "uniqueItems",
        "properties.tags",
    ),
    "nested in $defs and anyOf": (
        {"$defs": {"n": {"anyOf": [{"type": "integer", "not": {"const": 0}}]}}, "$ref": "#/$defs/n"},
        0,
        "not",
        "$defs.n.anyOf.0",
    ),
    "nested in items": (
        {"type": "array", "items": {"type": "number", "multipleOf": 0.5}},
        [0.3],
        "multipleOf",
        "items",
    ),
}

#: (schema, a value it refuses): keywords xgrammar does enforce, kept.
KEPT = {
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": INT},
        {"b": 1},
    ),
    "maxProperties": ({"type": "object", "maxProperties": 1, "additionalProperties": INT}, {"a": 1, "b": 2}),
    "format email": ({"type": "string", "format": "email"}, "xx"),
    "format date": ({"type": "string", "format": "date"}, "2020-13-45x"),
    "multipleOf of an integer": ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 99}, 4),
    "oneOf, distinct types": (
        {"oneOf": [{"type": "integer", "maximum": 9}, {"type": "string", "maxLength": 3}]},
        1.5,
    ),
    "oneOf, tagged": (
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}, "n": INT}, "required": ["k", "n"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ]
        },
        {"k": "c"},
    ),
    "allOf, one entry": ({"allOf": [{"type": "integer", "minimum": 3, "maximum": 5}]}, 9),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 3, "minimum": 0}, 3),
    "unevaluatedProperties": ({**OBJECT_AB, "unevaluatedProperties": False}, {"c": 1}),
}


def _valid(schema: dict, value) -> bool:
    """``jsonschema``'s verdict, formats checked."""
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    return jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(value)


def _accepts(grammar, tokenizer, value) -> bool:
    """Whether the grammar lets a model write ``value`` (as ``json.dumps`` spaces it) and stop."""
    matcher = grammar.matcher()
    tokens = tokenizer.encode(json.dumps(value), add_special_tokens=False)
    stop = min(tokenizer.eos_token_ids)
    return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(stop)


@pytest.fixture(scope="module")
def backend(tokenizer, vocab_size):
    """xgrammar itself, below the compiler's check this module is about."""
    from pagedkv.engine.structured.xgrammar_backend import XgrammarBackend

    return XgrammarBackend(tokenizer.backend, vocab_size, tokenizer.eos_token_ids)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_keyword_the_grammar_does_not_enforce_is_refused_by_name(backend, compiler, tokenizer, case):
    schema, value, keyword, where = REFUSED[case]
    assert not _valid(schema, value)
    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar

    compiled = backend.compile("json", json.dumps(schema), "none")
    grammar = CompiledGrammar(("json", json.dumps(schema), "none"), compiled, 0.0, guard=backend.utf8_guard)
    assert _accepts(grammar, tokenizer, value), "xgrammar enforces it now: it need not be refused"
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(StructuredOutputsParams(json=schema))
    at = f" (at {where})" if where else ""
    assert f"structured_outputs.json: json schema keyword {keyword!r}{at} is not supported" in str(
        refused.value
    )
    assert refused.value.param == "structured_outputs.json"


@pytest.mark.parametrize("case", list(KEPT))
def test_a_keyword_the_grammar_enforces_is_kept(compiler, tokenizer, vocab_size, case):
    schema, value = KEPT[case]
    assert unsupported_keyword(schema) is None
    assert not _valid(schema, value)
    grammar = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert not _accepts(grammar, tokenizer, value)
    for seed in range(10):
        tokens = random_walk(grammar.matcher(), vocab_size, seed)
        assert _valid(schema, json.loads(tokenizer.decode(tokens[:-1])))


def test_keywords_are_read_where_schemas_sit_not_in_values_or_names():
    """``not`` as a property's name, or inside a ``const`` value, is no keyword."""
    schema = {
        "type": "object",
        "properties": {"not": INT, "if": {"const": {"uniqueItems": True, "not": 1}}},
        "required": ["not"],
    }
    assert unsupported_keyword(schema) is None
    assert unsupported_keyword({"type": "array", "uniqueItems": False}) is None
