"""The grammar compiler: off the calling thread, once per spec, within the deployer's limits."""

from __future__ import annotations

import json
import threading

import pytest

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.engine.structured.config import StructuredOutputsConfig, schema_depth
from pagedkv.engine.validation import InvalidRequestError
from tests.engine.structured.test_walks import SCHEMA


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_spec_compiled_once_is_the_same_object_after(compiler):
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    again = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    as_text = compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=4)))
    assert again is first
    assert as_text is first  # the same schema written with other spacing
    assert first.key == StructuredOutputsParams(json=SCHEMA).key()


def test_what_changes_the_grammar_changes_the_compiled_object(compiler):
    loose = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    tight = compiler.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    properties = dict(reversed(SCHEMA["properties"].items()))  # the order the output follows
    reordered = compiler.compile(StructuredOutputsParams(json={**SCHEMA, "properties": properties}))
    assert len({id(loose), id(tight), id(reordered)}) == 3


def test_the_cache_forgets_the_least_recently_used_spec(make_compiler):
    compiler = make_compiler(StructuredOutputsConfig(cache_size=2))
    a, b, c = (StructuredOutputsParams(regex=f"[a-z]{{{n}}}") for n in (1, 2, 3))
    first_a, first_b = compiler.compile(a), compiler.compile(b)
    assert compiler.compile(a) is first_a  # a is now the most recently used
    compiler.compile(c)  # evicts b
    assert compiler.compile(a) is first_a
    assert compiler.compile(b) is not first_b


def test_compiles_run_on_the_compilers_threads(compiler):
    compiled = compiler.compile(StructuredOutputsParams(regex="(yes|no)[0-9]{3}"))
    assert compiled.compiled_on.startswith("pagedkv-grammar")
    assert compiled.compiled_on != threading.current_thread().name
    assert compiled.compile_seconds > 0


def test_requests_for_one_spec_share_one_compile(compiler):
    params = StructuredOutputsParams(regex="[0-9]{4}-shared")
    futures = [compiler.compile_async(params) for _ in range(4)]
    assert len({id(f.result()) for f in futures}) == 1


@pytest.mark.parametrize(
    ("params", "field", "reason"),
    [
        (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex", "Unclosed '['"),
        (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex", "parsing error"),
        (
            StructuredOutputsParams(json={"type": "strin"}),
            "structured_outputs.json",
            'Unsupported type "strin"',
        ),
        (
            StructuredOutputsParams(grammar="root ::= foo"),
            "structured_outputs.grammar",
            'Rule "foo" is not defined',
        ),
        (StructuredOutputsParams(grammar="start: foo"), "structured_outputs.grammar", "unknown name 'foo'"),
    ],
    ids=["regex-class", "regex-group", "json-type", "ebnf-rule", "lark-name"],
)
def test_an_invalid_spec_is_refused_naming_the_field(compiler, params, field, reason):
    future = compiler.compile_async(params)
    with pytest.raises(InvalidRequestError) as refused:
        future.result()
    assert refused.value.param == field
    assert str(refused.value).startswith(f"{field} is not valid: ")
    assert reason in str(refused.value)
    assert "/project/cpp/" not in str(refused.value)  # the library's source locations stay out
    again = compiler.compile_async(params)  # a refusal is remembered: no second compile
    assert again.done() and again.exception() is refused.value


@pytest.mark.parametrize(
    ("config", "params", "message"),
    [
        (
            StructuredOutputsConfig(max_spec_chars=20),
            StructuredOutputsParams(regex="[a-z]{1,8}@[a-z]{1,6}"),
            "structured_outputs.regex is 21 characters long, over the limit max_spec_chars = 20",
        ),
        (
            StructuredOutputsConfig(max_spec_chars=10),
            StructuredOutputsParams(choice=["alpha", "beta"]),
            "structured_outputs.choice is 16 characters long, over the limit max_spec_chars = 10",
        ),
        (
            StructuredOutputsConfig(max_schema_depth=9),
            StructuredOutputsParams(json=nested_schema(5)),
            "structured_outputs.json nests 11 levels deep, over the limit max_schema_depth = 9",
        ),
    ],
    ids=["regex-length", "choice-length", "schema-depth"],
)
def test_a_spec_over_a_limit_is_refused_before_it_compiles(make_compiler, config, params, message):
    compiler = make_compiler(config)
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile_async(params)  # raises at once: there is no future to wait for
    assert str(refused.value) == message
    assert refused.value.param == message.split()[0]


def test_a_spec_with_an_unpaired_surrogate_is_refused(compiler):
    with pytest.raises(InvalidRequestError, match="not valid Unicode") as refused:
        compiler.compile_async(StructuredOutputsParams(choice=["ok", "bad\ud800"]))
    assert refused.value.param == "structured_outputs.choice"


def test_a_compile_over_the_time_limit_is_refused_and_stays_refused(make_compiler):
    params = StructuredOutputsParams(json=nested_schema(12))
    strict = make_compiler(StructuredOutputsConfig(max_compile_seconds=1e-9))
    with pytest.raises(InvalidRequestError) as refused:
        strict.compile(params)
    assert str(refused.value) == (
        "structured_outputs.json is too costly to compile: still compiling after "
        "max_compile_seconds = 1e-09 s"
    )
    assert refused.value.param == "structured_outputs.json"
    again = strict.compile_async(params)
    assert again.done() and again.exception() is refused.value
    # the spec itself is fine: only its cost was refused
    assert make_compiler().compile(params).key == params.key()


def test_a_closed_compiler_compiles_nothing(make_compiler):
    compiler = make_compiler()
    compiler.close()
    with pytest.raises(RuntimeError, match="shut down"):
        compiler.compile_async(StructuredOutputsParams(regex="abc"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_spec_chars", 0),
        ("max_schema_depth", True),
        ("cache_size", 1.5),
        ("compile_threads", -1),
        ("max_compile_seconds", 0),
        ("max_compile_seconds", float("nan")),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"StructuredOutputsConfig\.{field} must be a positive"):
        StructuredOutputsConfig(**{field: value})


@pytest.mark.parametrize(
    ("value", "depth"),
    [(3, 0), ("s", 0), ({}, 1), ([1, 2], 1), ({"a": {"b": []}}, 3), ([[[]], {}], 3), (nested_schema(2), 5)],
)
def test_schema_depth_counts_nested_containers(value, depth):
    assert schema_depth(value) == depth
