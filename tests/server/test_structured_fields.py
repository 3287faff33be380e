"""The other servers' names for a constraint, JSON's whitespace, and ``parallel_tool_calls``, by effect.

llama.cpp's ``json_schema`` and ``grammar`` (GBNF) and SGLang's ``regex`` and ``ebnf``, sent
through the ``openai`` client's ``extra_body``, constrain the answer as vLLM's own fields do:
every answer validates or matches. ``guided_whitespace_pattern`` spaces JSON as it says.
``parallel_tool_calls: false`` keeps one call, under ``"auto"`` too.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.server.helpers import API_KEY, MODEL, assert_pool_whole, wait_idle

ASK = [{"role": "user", "content": "Return a small JSON object."}]
ITEM = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["color", "count"],
    "additionalProperties": False,
}
#: llama.cpp's GBNF, with its spelling of an optional rule (an empty alternative).
GBNF = r"""root ::= "n=" digits sign
digits ::= [0-9] | [0-9] [0-9]
sign ::= | "+" | "-"
"""
EBNF = 'root ::= ("yes" | "no") "!"{1,3}'
CODE = r"[A-Z]{2}-[0-9]{3}"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s", "unit": "celsius"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(num_kv_blocks=512, block_size=16, max_model_len=512, max_num_seqs=32)
    app = create_app(config, api_key=API_KEY, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(app) as running:
        yield running
    assert_pool_whole(running.app.state.engine.engine)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as made:
        yield made


def _texts(client, extra_body: dict, seeds=range(4), max_tokens: int = 64) -> list[str]:
    texts = []
    for seed in seeds:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            n=2,
            temperature=1.0,
            seed=seed,
            max_tokens=max_tokens,
            extra_body=extra_body,
        )
        for choice in answer.choices:
            assert choice.finish_reason == "stop", choice
            texts.append(choice.message.content)
    return texts


def test_llama_cpps_json_schema_constrains_the_answer(client, server):
    for text in _texts(client, {"json_schema": ITEM}):
        jsonschema.validate(json.loads(text), ITEM)
    wait_idle(server.base_url)


def test_llama_cpps_gbnf_grammar_constrains_the_answer(client, server):
    for text in _texts(client, {"grammar": GBNF}):
        assert re.fullmatch(r"n=[0-9]{1,2}[+-]?", text), text


def test_sglangs_regex_and_ebnf_constrain_the_answer(client, server):
    for text in _texts(client, {"regex": CODE}):
        assert re.fullmatch(CODE, text), text
    for text in _texts(client, {"ebnf": EBNF}):
        assert re.fullmatch(r"(yes|no)!{1,3}", text), text
    wait_idle(server.base_url)


def test_two_constraints_under_any_names_are_a_400_naming_the_second(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, extra_body={"json_schema": ITEM, "regex": CODE}
        )
    assert refused.value.body["param"] == "regex"
    assert "regex cannot be combined with json_schema" in refused.value.body["message"]


def test_a_whitespace_pattern_spaces_the_json_as_it_says(client, server):
    """One space exactly between every two tokens: ``{ "color" : "red" , "count" : 7 }``."""
    texts = _texts(client, {"json_schema": ITEM, "guided_whitespace_pattern": " "})
    for text in texts:
        jsonschema.validate(json.loads(text), ITEM)
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', text)
        assert re.fullmatch(r'\{ "" : "" , "" : [0-9]+ \}', outside_strings), text
    wait_idle(server.base_url)


@pytest.mark.parametrize(
    ("extra_body", "says"),
    [
        ({"guided_whitespace_pattern": " ?"}, "constrains its output to no JSON"),
        ({"regex": CODE, "guided_whitespace_pattern": " ?"}, "constrains its output to no JSON"),
        ({"json_schema": ITEM, "guided_whitespace_pattern": "[ x]?"}, "matches more than whitespace"),
    ],
)
def test_a_whitespace_pattern_that_cannot_be_honoured_is_a_400_naming_it(client, extra_body, says):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra_body)
    assert refused.value.body["param"] == "guided_whitespace_pattern"
    assert says in refused.value.body["message"]


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(client, server):
    """The model is made to write two calls (a one-choice constraint beside the tools); the
    hermes parser finds both, and ``parallel_tool_calls: false`` keeps the first, whole or streamed."""
    two_calls = CALL % "Paris" + CALL % "Oslo"
    common = dict(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=256, extra_body={"guided_choice": [two_calls]}
    )
    both = client.chat.completions.create(**common)
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == [
        "Paris",
        "Oslo",
    ]
    one = client.chat.completions.create(parallel_tool_calls=False, **common)
    [call] = one.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert one.choices[0].finish_reason == "tool_calls"
    streamed = client.chat.completions.create(parallel_tool_calls=False, stream=True, **common)
    deltas = [d for chunk in streamed for choice in chunk.choices for d in choice.delta.tool_calls or []]
    assert [(d.index, json.loads(d.function.arguments)["city"]) for d in deltas] == [(0, "Paris")]
    wait_idle(server.base_url)
