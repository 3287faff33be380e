"""Structured output and forced tool calls on a real model, with the server's default settings.

SmolLM2-135M-Instruct at temperature 1.0 through the ``openai`` client, ten seeded requests
each: a strict ``json_schema`` answer within 120 tokens and ``tool_choice: "required"`` with a
weather tool within 80 must all come back whole and valid. What makes them: JSON spaced with
one optional space by default (a small model given any whitespace writes runs of newlines and
indents until ``max_tokens``), and a ``"required"`` array cut after whole calls keeps them.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.real_model import ENGINE_OPTIONS
from tests.server.helpers import API_KEY, assert_pool_whole, wait_idle

MODEL = "smollm2"
SEEDS = range(10)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def server(real_model):
    config = EngineConfig(model=str(real_model), **ENGINE_OPTIONS, max_num_seqs=16)
    with ServerThread(create_app(config, api_key=API_KEY, served_model_name=MODEL)) as running:
        yield running
    assert_pool_whole(running.app.state.engine.engine)


def _ask_all(server, **body) -> list:
    """One request per seed, concurrently; their first choices."""

    async def gather():
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=600
        ) as client:
            answers = await asyncio.gather(
                *[client.chat.completions.create(model=MODEL, temperature=1.0, seed=s, **body) for s in SEEDS]
            )
        return [answer.choices[0] for answer in answers]

    return asyncio.run(gather())


def test_every_strict_json_schema_answer_is_whole_and_valid(server):
    choices = _ask_all(
        server,
        messages=[{"role": "user", "content": "Describe a person as JSON with name, age and city."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        max_tokens=120,
    )
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', choice.message.content)
        assert set(re.findall(r"\s+", outside_strings)) <= {" "}  # the default spacing
    wait_idle(server.base_url)


def _check_calls(choice) -> int:
    assert choice.message.tool_calls, (choice.finish_reason, choice.message.content)
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    return len(choice.message.tool_calls)


def test_every_required_tool_call_answer_carries_valid_calls(server):
    choices = _ask_all(
        server,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
    )
    for choice in choices:
        _check_calls(choice)
        assert choice.finish_reason in ("tool_calls", "length")  # length: whole calls, then a cut one
    wait_idle(server.base_url)


def test_parallel_tool_calls_false_gets_exactly_one_call(server):
    choices = _ask_all(
        server,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    for choice in choices:
        assert _check_calls(choice) == 1 and choice.finish_reason == "tool_calls"
    wait_idle(server.base_url)
