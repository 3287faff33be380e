"""StructuredOutputsParams: exactly one constraint, each field checked with a message naming it."""

from __future__ import annotations

import pytest

from pagedkv.engine.structured import StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({}, "none"),
        ({"json_object": False}, "none"),
        ({"regex": "a", "choice": ["a"]}, "regex, choice"),
        ({"json": {}, "grammar": "root ::= x", "json_object": True}, "json, grammar, json_object"),
    ],
)
def test_exactly_one_constraint_is_set(kwargs, named):
    with pytest.raises(
        ValueError, match=f"exactly one of json, regex, choice, grammar or json_object, got {named}$"
    ):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": "{not json"}, "StructuredOutputsParams.json must be a JSON schema; its text is not JSON"),
        ({"json": "[" * 100_000}, "StructuredOutputsParams.json must be a JSON schema; its text is not JSON"),
        ({"json": "[1, 2]"}, "StructuredOutputsParams.json must be a JSON schema object, got [1, 2]"),
        ({"json": 3}, "StructuredOutputsParams.json must be a JSON schema object, got 3"),
        ({"regex": ""}, "StructuredOutputsParams.regex must be a non-empty string, got ''"),
        ({"regex": 5}, "StructuredOutputsParams.regex must be a non-empty string, got 5"),
        ({"grammar": b"root ::= x"}, "StructuredOutputsParams.grammar must be a non-empty string"),
        ({"choice": []}, "StructuredOutputsParams.choice must be a non-empty list of strings, got []"),
        ({"choice": "yes"}, "StructuredOutputsParams.choice must be a non-empty list of strings, got 'yes'"),
        ({"choice": ["yes", ""]}, "StructuredOutputsParams.choice must be a list of non-empty strings"),
        ({"choice": ["yes", 1]}, "StructuredOutputsParams.choice must be a list of non-empty strings"),
        ({"json_object": "yes"}, "StructuredOutputsParams.json_object must be True or None, got 'yes'"),
        ({"json_object": 1}, "StructuredOutputsParams.json_object must be True or None, got 1"),
        ({"regex": 0}, "StructuredOutputsParams.regex must be a non-empty string, got 0"),
        (
            {"regex": "a", "disable_any_whitespace": "no"},
            "StructuredOutputsParams.disable_any_whitespace must be a bool, got 'no'",
        ),
    ],
)
def test_a_bad_field_is_refused_naming_it(kwargs, message):
    with pytest.raises(ValueError) as refused:
        StructuredOutputsParams(**kwargs)
    assert str(refused.value).startswith(message)


def test_a_long_bad_value_is_shortened_in_the_message():
    with pytest.raises(ValueError) as refused:
        StructuredOutputsParams(choice=["ok"] * 1000 + [7])
    assert len(str(refused.value)) < 300 and str(refused.value).endswith("...")


def test_json_text_becomes_the_schema_it_holds():
    params = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert params.json == {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert params.kind == "json"


@pytest.mark.parametrize(
    ("params", "kind", "spec"),
    [
        (
            StructuredOutputsParams(json={"type": "string", "maxLength": 3}),
            "json",
            '{"type":"string","maxLength":3}',
        ),
        (StructuredOutputsParams(regex="[0-9]+"), "regex", "[0-9]+"),
        (StructuredOutputsParams(choice=["é", 'a"b']), "choice", '["é","a\\"b"]'),
        (StructuredOutputsParams(grammar="root ::= x"), "grammar", "root ::= x"),
        (StructuredOutputsParams(json_object=True), "json_object", ""),
    ],
)
def test_kind_and_spec_name_the_constraint(params, kind, spec):
    assert (params.kind, params.spec) == (kind, spec)


def test_keys_are_equal_exactly_when_the_grammar_is_the_same():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    key = StructuredOutputsParams(json=schema).key()
    assert StructuredOutputsParams(json=schema).key() == key
    assert StructuredOutputsParams(json=" " + str(schema).replace("'", '"')).key() == key
    assert StructuredOutputsParams(json=reordered).key() != key  # properties come out in their order
    assert StructuredOutputsParams(json=schema, disable_any_whitespace=True).key() != key
    # whitespace only shapes JSON: a regex's grammar is the same either way
    regex = StructuredOutputsParams(regex="[a-z]+")
    assert StructuredOutputsParams(regex="[a-z]+", disable_any_whitespace=True).key() == regex.key()
    assert StructuredOutputsParams(grammar="[a-z]+").key() != regex.key()
