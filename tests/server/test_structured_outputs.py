"""Structured output and forced tool calls through the real ``openai`` client against a real server.

For each way of asking -- ``chat.completions.parse`` with a pydantic model, ``response_format``
``json_schema`` with ``strict``, a regex, a choice, and ``tool_choice="required"`` -- 50 seeded
requests at temperature 1.0 with n = 3, streamed and not: every one of their answers must
parse and validate. The built-in model is tiny, so the schemas bound their strings and numbers:
each answer completes well within ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from pagedkv.engine import EngineConfig
from pagedkv.engine.structured.config import StructuredOutputsConfig
from pagedkv.server import ServerThread, create_app
from tests.server.helpers import API_KEY, MODEL, assert_pool_whole, wait_idle

REQUESTS, N = 50, 3
ASK = [{"role": "user", "content": "Return a JSON object with name, age, city."}]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=16)


ITEM = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
CODE = r"[A-Z][a-z]{2,8}-[0-9]{1,3}"
LABELS = ["positive", "negative", "neutral"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_numbers",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 999},
                    "b": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def server():
    """``--structured-outputs-disable-any-whitespace``: the built-in model, a tiny one, can loop on
    whitespace where JSON allows it (``docs/structured-output.md``); hermes for tool_choice auto."""
    config = EngineConfig(
        num_kv_blocks=2048,
        block_size=16,
        max_model_len=1024,
        max_num_seqs=160,
        structured_outputs_config=StructuredOutputsConfig(disable_any_whitespace=True),
    )
    app = create_app(config, api_key=API_KEY, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(app) as running:
        yield running
    assert_pool_whole(running.app.state.engine.engine)


@pytest.fixture(scope="module")
def run(server) -> Callable[[Callable[[openai.AsyncOpenAI], list[Awaitable]]], list]:
    """``run(lambda client: [coroutines])``: their results, concurrently, on one fresh client
    (an async client belongs to the event loop it was made in)."""

    def run_all(make: Callable[[openai.AsyncOpenAI], list[Awaitable]]) -> list:
        async def gather():
            async with openai.AsyncOpenAI(
                base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300
            ) as client:
                return await asyncio.gather(*make(client))

        return asyncio.run(gather())

    return run_all


async def _collect(stream) -> list[dict]:
    """A streamed chat answer per choice: its content, tool calls (by index) and finish reason."""
    choices: dict[int, dict] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            state = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish_reason": None})
            state["content"] += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = state["calls"].setdefault(delta.index, {"id": delta.id, "name": None, "arguments": ""})
                call["name"] = call["name"] or delta.function.name
                call["arguments"] += delta.function.arguments or ""
            state["finish_reason"] = choice.finish_reason or state["finish_reason"]
    return [choices[i] for i in sorted(choices)]


def _plain(response) -> list[dict]:
    return [
        {
            "content": c.message.content or "",
            "calls": {
                i: {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                for i, t in enumerate(c.message.tool_calls or [])
            },
            "finish_reason": c.finish_reason,
        }
        for c in response.choices
    ]


async def _answers(client, stream: bool, seed: int, **body) -> list[dict]:
    common = dict(model=MODEL, n=N, temperature=1.0, seed=seed, max_tokens=96)
    if stream:
        return await _collect(await client.chat.completions.create(stream=True, **common, **body))
    return _plain(await client.chat.completions.create(**common, **body))


def _check_person(answer: dict) -> None:
    Person.model_validate_json(answer["content"])


def _check_item(answer: dict) -> None:
    jsonschema.validate(json.loads(answer["content"]), ITEM)


def _check_code(answer: dict) -> None:
    assert re.fullmatch(CODE, answer["content"]), answer["content"]


def _check_label(answer: dict) -> None:
    assert answer["content"] in LABELS, answer["content"]


def _check_calls(answer: dict) -> None:
    assert answer["finish_reason"] == "tool_calls" and answer["content"] == ""
    assert len(answer["calls"]) == 1  # parallel_tool_calls: false
    for call in answer["calls"].values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


CASES: dict[str, tuple[dict, Callable[[dict], None]]] = {
    "json_schema strict": (
        {
            "messages": ASK,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "item", "schema": ITEM, "strict": True},
            },
        },
        _check_item,
    ),
    "regex": ({"messages": ASK, "extra_body": {"structured_outputs": {"regex": CODE}}}, _check_code),
    "choice": ({"messages": ASK, "extra_body": {"guided_choice": LABELS}}, _check_label),
    "tool_choice required": (
        {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        _check_calls,
    ),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_seeded_answer_parses_and_validates(run, server, case, stream):
    body, check = CASES[case]
    results = run(lambda client: [_answers(client, stream, seed, **body) for seed in range(REQUESTS)])
    answers = [answer for result in results for answer in result]
    assert len(answers) == REQUESTS * N
    for answer in answers:
        if case != "tool_choice required":
            assert answer["finish_reason"] == "stop" and not answer["calls"], answer
        check(answer)
    wait_idle(server.base_url)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions_parse_returns_the_pydantic_model(run, server, stream):
    """``parse`` (and ``stream`` with a ``response_format`` model) sends the model's strict
    schema and reads every answer back into the model."""
    options = dict(model=MODEL, messages=ASK, response_format=Person, n=N, temperature=1.0, max_tokens=96)

    async def parse(client, seed: int):
        if not stream:
            return await client.chat.completions.parse(seed=seed, **options)
        async with client.chat.completions.stream(seed=seed, **options) as events:
            return await events.get_final_completion()

    completions = run(lambda client: [parse(client, seed) for seed in range(REQUESTS)])
    parsed = [choice.message.parsed for completion in completions for choice in completion.choices]
    assert len(parsed) == REQUESTS * N and all(isinstance(p, Person) for p in parsed)
    assert len({p.model_dump_json() for p in parsed}) > REQUESTS  # samples, not one answer repeated
    wait_idle(server.base_url)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_gets_arguments_that_validate(run, server, stream):
    """The answer is the named function's arguments; streamed, they arrive as they are written."""
    choice = {"type": "function", "function": {"name": "add_numbers"}}
    body = dict(messages=ASK, tools=TOOLS, tool_choice=choice)
    results = run(lambda client: [_answers(client, stream, seed, **body) for seed in range(10)])
    for answer in (a for result in results for a in result):
        assert answer["finish_reason"] == "stop" and answer["content"] == ""  # as OpenAI answers it
        [call] = answer["calls"].values()
        assert call["name"] == "add_numbers" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["add_numbers"])
    wait_idle(server.base_url)


WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _summary(answer: dict) -> tuple:
    calls = [(c["name"], json.loads(c["arguments"])) for c in answer["calls"].values()]
    return answer["content"], calls, answer["finish_reason"]


def test_auto_tool_choice_reads_the_models_own_calls_alike_streamed_or_not(run, server):
    """With ``tool_choice`` auto the model decides and the hermes parser reads its answer.
    Seeded, the streamed answers say exactly what the whole ones say (content held back while it
    could begin a call is released), and any call found is a tool's, with arguments that parse."""

    async def both(client, seed: int):
        body = dict(messages=WEATHER_ASK, tools=TOOLS)
        return await _answers(client, False, seed, **body), await _answers(client, True, seed, **body)

    results = run(lambda client: [both(client, seed) for seed in range(10)])
    summaries = []
    for whole, streamed in results:
        assert [_summary(a) for a in whole] == [_summary(a) for a in streamed]
        summaries += [_summary(a) for a in whole]
    assert len(summaries) == 10 * N
    for content, calls, reason in summaries:
        assert all(name in SCHEMAS for name, _ in calls)
        assert reason in (("tool_calls",) if calls else ("stop", "length")), (content, calls, reason)
    wait_idle(server.base_url)


def test_tool_choice_none_answers_in_text_with_the_tools_in_the_prompt(run, server):
    (answer,) = run(
        lambda client: [
            client.chat.completions.create(
                model=MODEL,
                messages=WEATHER_ASK,
                tools=TOOLS,
                tool_choice="none",
                max_tokens=8,
                temperature=0.0,
            )
        ]
    )
    assert answer.choices[0].message.tool_calls in (None, []) and answer.choices[0].finish_reason in (
        "stop",
        "length",
    )
    with_tools = _render(server, {"messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": "none"})
    without = _render(server, {"messages": WEATHER_ASK})
    assert "<tools>" in with_tools and "get_weather" in with_tools and "<tools>" not in without


def _render(server, body: dict) -> str:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions/render",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    engine = server.app.state.engine.engine
    return engine.tokenizer.decode(response.json()["token_ids"], skip_special_tokens=False)


def test_a_conversation_carries_earlier_calls_and_their_results_to_the_template(server):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *WEATHER_ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    ]
    prompt = _render(server, {"messages": messages, "tools": TOOLS, "tool_choice": "none"})
    arguments = '{"city": "Paris", "unit": "celsius"}'
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 degrees\n</tool_response>" in prompt


def test_unconstrained_completions_are_unchanged_by_constrained_ones_beside_them(run, server):
    """Greedy completions alone, then again among constrained requests: the same text, token
    by token (the mask touches the constrained rows only)."""
    plain = [f"def step_{i}(self):" for i in range(6)]

    async def complete(client, prompt: str, **extra):
        response = await client.completions.create(
            model=MODEL, prompt=prompt, logprobs=1, **({"temperature": 0.0, "max_tokens": 24} | extra)
        )
        return response.choices[0].text, response.choices[0].logprobs.token_logprobs

    alone = run(lambda client: [complete(client, p) for p in plain])

    def mixed_batch(client):
        json_item = {"guided_json": ITEM}
        constrained = [
            complete(client, "x = ", seed=s, temperature=1.0, max_tokens=96, extra_body=json_item)
            for s in range(6)
        ]
        return [
            c for pair in zip([complete(client, p) for p in plain], constrained, strict=True) for c in pair
        ]

    mixed = run(mixed_batch)
    assert mixed[0::2] == alone
    for text, _ in mixed[1::2]:
        jsonschema.validate(json.loads(text), ITEM)
    wait_idle(server.base_url)
