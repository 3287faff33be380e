"""The tool call parsers and the per-choice reader of tool calls, on answers written by hand.

Every answer is read whole (the non-streaming response) and streamed in pieces of every size
(the streaming response): both must give the same content and the same calls, and a stream
must never show as content text that turns out to be a call.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.server.tool_calls import AnswerTools, parse_required
from pagedkv.server.tool_parsers import TOOL_PARSERS, ParsedCall, tool_parser

WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')

HERMES = [
    ("plain text, no call", "plain text, no call", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [WEATHER]),
    (
        'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        "Let me look.\n",
        [WEATHER, ParsedCall("add", '{"a": 1, "b": 2}')],
    ),
    # the last call cut by the end of the answer, its closing tag missing
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),
    ('<tool_call>{"name": "noargs"}</tool_call>', None, [ParsedCall("noargs", "{}")]),
    # not a call: the whole answer is content, as written
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
]

LLAMA3 = [
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
    ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),
    (
        ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1}}',
        None,
        [WEATHER, ParsedCall("add", '{"a": 1}')],
    ),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}} and more', None, None),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    (
        '{"name": "get_weather", "parameters": {"city": "Par',
        '{"name": "get_weather", "parameters": {"city": "Par',
        [],
    ),
]


@pytest.mark.parametrize(("name", "cases"), [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_parsers_find_the_calls_or_keep_the_text(name, cases):
    parser = tool_parser(name)
    for text, content, calls in cases:
        parsed = parser.parse(text)
        if calls is None:  # trailing text after the calls: all content
            assert parsed.calls == [] and parsed.content == text
            continue
        assert parsed.calls == calls, text
        assert parsed.content == content, text


def test_parsers_are_registered_by_vllms_names_and_unknown_ones_are_refused():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json"]
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'; known: hermes, llama3_json"):
        tool_parser("mistral")


def _stream(answer: AnswerTools, text: str, cuts: list[int], finish: str):
    """Feed ``text`` in pieces ending at ``cuts``; the concatenated content and calls sent."""
    bounds = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    content, calls, reason, start = "", {}, None, 0
    for end in bounds:
        piece, start = text[start:end], end
        sent, deltas, reason = answer.stream(piece, finish if end == len(text) else None)
        content += sent or ""
        for delta in deltas or []:
            call = calls.setdefault(
                delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""}
            )
            call["arguments"] += delta.function.arguments or ""
    return content, calls, reason


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(HERMES), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_streamed_hermes_answer_says_what_the_whole_one_says(case, cuts):
    text = case[0]
    whole_content, whole_calls, whole_reason = AnswerTools("auto", tool_parser("hermes")).complete(
        text, "stop"
    )
    content, calls, reason = _stream(AnswerTools("auto", tool_parser("hermes")), text, cuts, "stop")
    assert content == (whole_content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole_calls
    ]
    assert reason == whole_reason == ("tool_calls" if whole_calls else "stop")
    assert all(c["id"].startswith("call_") for c in calls.values())


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 60), max_size=8))
def test_a_named_call_streams_its_arguments_as_they_come(cuts):
    arguments = '{"city": "Paris", "unit": "celsius"}'
    content, calls, reason = _stream(
        AnswerTools("named", function_name="get_weather"), arguments, cuts, "stop"
    )
    assert content == "" and reason == "stop"  # a forced named call finishes as OpenAI's does
    assert list(calls.values()) == [{"id": calls[0]["id"], "name": "get_weather", "arguments": arguments}]


def test_required_answers_parse_into_calls_or_stay_text():
    text = json.dumps(
        [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {}}]
    )
    parsed = parse_required(text)
    assert parsed.content is None and [c.name for c in parsed.calls] == ["get_weather", "add"]
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris"}
    for cut in ('[{"name": "get_weather", "parameters": {"ci', "[]", '{"name": "x"}'):
        assert parse_required(cut).calls == [] and parse_required(cut).content == cut
    content, calls, reason = AnswerTools("required").complete(text[:20], "length")
    assert (content, calls, reason) == (text[:20], [], "length")


def test_a_required_array_cut_by_max_tokens_keeps_its_whole_calls():
    whole = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "add", "parameters": {"a": 1}},
    ]
    text = json.dumps(whole)[:-1] + ', {"name": "get_weather", "parameters": {"ci'
    content, calls, reason = AnswerTools("required").complete(text, "length")
    assert content is None and reason == "length"  # the client still sees the answer was cut
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1}),
    ]
    streamed, stream_calls, stream_reason = _stream(AnswerTools("required"), text, [5, 30, 60], "length")
    assert streamed == "" and stream_reason == "length" and len(stream_calls) == 2


def test_one_call_keeps_the_first_call_the_parser_found():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    )
    hermes = tool_parser("hermes")
    _, calls, reason = AnswerTools("auto", hermes, one_call=True).complete(text, "stop")
    assert [c.function.name for c in calls] == ["get_weather"] and reason == "tool_calls"
    _, calls, _ = AnswerTools("auto", hermes).complete(text, "stop")
    assert [c.function.name for c in calls] == ["get_weather", "add"]
