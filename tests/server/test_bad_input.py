"""Every bad input the README's table lists, sent over raw HTTP: its status and OpenAI error body.

``BAD_INPUTS`` *is* the table: one row per case, each run as its own test. After each, the
server must still be healthy with the pool whole (a refused request must not hold a block).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.server.conftest import MAX_BODY_BYTES
from tests.server.helpers import (
    API_KEY,
    ENGINE_OPTIONS,
    MODEL,
    EngineGate,
    assert_pool_whole,
    scrape,
    wait_idle,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
#: The tight server: a 40-block (640-token) cache under a 1024-token context, one sequence at a
#: time and at most one waiting request.
TIGHT = dict(num_kv_blocks=40, block_size=16, max_model_len=1024, max_num_seqs=1)
#: Tokens the main server's pool holds: its default --max-request-tokens.
POOL_TOKENS = ENGINE_OPTIONS["num_kv_blocks"] * ENGINE_OPTIONS["block_size"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def _chunked(data: bytes, size: int = 4096):
    """A body sent with chunked transfer encoding: no Content-Length to refuse it by."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


@dataclass(frozen=True)
class BadInput:
    what: str
    status: int
    body: dict | bytes | None = None
    path: str = "/v1/completions"
    headers: dict | list = field(default_factory=lambda: {**AUTH, **JSON})
    #: a fragment of the error message, and the ``param`` it must name
    says: str = ""
    param: str | None = None
    chunked: bool = False


BAD_INPUTS = [
    BadInput("no `Authorization` header on a `/v1` route", 401, _completion(), headers=JSON, says="API key"),
    BadInput(
        "wrong API key", 401, _completion(), headers={"Authorization": "Bearer nope", **JSON}, says="API key"
    ),
    BadInput("API key without the `Bearer` scheme", 401, _completion(), headers={"Authorization": API_KEY}),
    BadInput(
        "two `Authorization` headers (even if one is right)",
        401,
        _completion(),
        headers=[("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer other"), *JSON.items()],
        says="2 Authorization headers",
    ),
    BadInput("malformed JSON", 400, b'{"prompt": "hi",', says="not valid JSON"),
    BadInput("empty body", 400, b"", says="empty"),
    BadInput("JSON that is not an object", 400, b"[1, 2]", says="valid dictionary"),
    BadInput("missing `prompt`", 400, {"model": MODEL}, says="prompt: Field required", param="prompt"),
    BadInput("`prompt` of the wrong type", 400, _completion(prompt=5), param="prompt.str"),
    BadInput("empty prompt list", 400, _completion(prompt=[]), says="must not be empty", param="prompt"),
    BadInput(
        "prompt token id outside the vocabulary",
        400,
        _completion(prompt=[5, 99999]),
        says="vocabulary",
        param="prompt",
    ),
    BadInput(
        "`stop_token_ids` outside the vocabulary",
        400,
        _completion(min_tokens=1, stop_token_ids=[2048]),
        says="vocabulary",
        param="stop_token_ids",
    ),
    BadInput(
        "chat: `stop_token_ids` outside the vocabulary",
        400,
        _chat(stop_token_ids=[99999]),
        path="/v1/chat/completions",
        says="vocabulary",
        param="stop_token_ids",
    ),
    BadInput(
        "prompt longer than the model allows",
        400,
        _completion(prompt=[5] * 300),
        says="maximum context",
        param="prompt",
    ),
    BadInput(
        "prompt + `max_tokens` over the context",
        400,
        _completion(max_tokens=300),
        says="maximum context",
        param="max_tokens",
    ),
    BadInput(
        "a text prompt that provably cannot fit, refused before tokenizing",
        400,
        _completion(prompt="x" * 14_000),
        says="at least",
        param="prompt",
    ),
    BadInput(
        "an unpaired surrogate in the prompt",
        400,
        b'{"prompt": "a\\ud800b", "max_tokens": 3}',
        says="unpaired UTF-16 surrogate",
        param="prompt",
    ),
    BadInput(
        "chat: an unpaired surrogate in `content`",
        400,
        b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
        path="/v1/chat/completions",
        says="surrogate",
        param="messages.0.content",
    ),
    BadInput(
        "chat: an unpaired surrogate in `role`",
        400,
        b'{"messages": [{"role": "\\udc00", "content": "hi"}]}',
        path="/v1/chat/completions",
        says="surrogate",
        param="messages.0.role",
    ),
    BadInput("`n` over `--max-n` (1,000,000)", 400, _completion(n=1_000_000), says="max_n = 128", param="n"),
    BadInput(
        "more prompts than `--max-prompts-per-request`",
        400,
        _completion(prompt=["b"] * 300, max_tokens=1),
        says="max_prompts_per_request = 256",
        param="prompt",
    ),
    BadInput(
        "prompts x n x (prompt + `max_tokens`) over `--max-request-tokens`",
        400,
        _completion(prompt=["hi"] * 200, n=16, max_tokens=100),
        says=f"max_request_tokens = {POOL_TOKENS}",  # by default, what the pool holds
        param="max_tokens",
    ),
    BadInput(
        "`priority` without `--scheduling-policy priority`",
        400,
        _completion(priority=1),
        says="--scheduling-policy priority",
        param="priority",
    ),
    BadInput("`priority` not an integer", 400, _completion(priority=0.5), param="priority"),
    BadInput("unknown model name", 400, _completion(model="gpt-4"), says="does not exist", param="model"),
    BadInput("`temperature` < 0", 400, _completion(temperature=-1), says=">= 0", param="temperature"),
    BadInput("`temperature` as a string", 400, _completion(temperature="hot"), param="temperature"),
    BadInput("`top_p` = 0", 400, _completion(top_p=0), says="(0, 1]", param="top_p"),
    BadInput("`top_p` > 1", 400, _completion(top_p=1.5), says="(0, 1]", param="top_p"),
    BadInput("`max_tokens` = 0", 400, _completion(max_tokens=0), says=">= 1", param="max_tokens"),
    BadInput("`n` = 0", 400, _completion(n=0), says=">= 1", param="n"),
    BadInput("`n` not an integer", 400, _completion(n=1.5), param="n"),
    BadInput("`logprobs` > 20", 400, _completion(logprobs=21), says="<= 20", param="logprobs"),
    BadInput(
        "`prompt_logprobs` > 20",
        400,
        _completion(prompt_logprobs=21),
        says="<= 20",
        param="prompt_logprobs",
    ),
    BadInput("`seed` beyond 64 bits", 400, _completion(seed=2**64), says="seed", param="seed"),
    BadInput("empty stop string", 400, _completion(stop=[""]), says="non-empty", param="stop"),
    BadInput("`stream` not a boolean", 400, _completion(stream="yes"), param="stream"),
    BadInput(
        "`use_beam_search` (not supported)",
        400,
        _completion(use_beam_search=True),
        says="not supported",
        param="use_beam_search",
    ),
    BadInput(
        "`truncate_prompt_tokens` = 0",
        400,
        _completion(truncate_prompt_tokens=0),
        says="must be -1 or in [1, max_model_len - max_tokens = 252]",
        param="truncate_prompt_tokens",
    ),
    BadInput(
        "`truncate_prompt_tokens` over the context less `max_tokens`",
        400,
        _completion(truncate_prompt_tokens=253),
        says="max_model_len - max_tokens = 252",
        param="truncate_prompt_tokens",
    ),
    BadInput(
        "`skip_special_tokens` not a boolean",
        400,
        _completion(skip_special_tokens="no"),
        param="skip_special_tokens",
    ),
    BadInput(
        "one prompt of a batch over the context, refused before tokenizing",
        400,
        _completion(prompt=["short", "x" * 10_000, "short"]),
        says="prompt 1: this model's maximum context length is 256 tokens, but the request asks for at least",
        param="prompt",
    ),
    BadInput(
        "render: prompt token id outside the vocabulary",
        400,
        _completion(prompt=[-1]),
        path="/v1/completions/render",
        says="vocabulary",
        param="prompt",
    ),
    BadInput(
        "render: prompt + `max_tokens` over the context",
        400,
        _completion(max_tokens=300),
        path="/v1/completions/render",
        says="maximum context",
        param="max_tokens",
    ),
    BadInput(
        "chat render: `priority` without `--scheduling-policy priority`",
        400,
        _chat(priority=-3),
        path="/v1/chat/completions/render",
        says="--scheduling-policy priority",
        param="priority",
    ),
    BadInput(
        "chat render: `n` over `--max-n`",
        400,
        _chat(n=1000),
        path="/v1/chat/completions/render",
        says="max_n = 128",
        param="n",
    ),
    BadInput(
        "`logit_bias` key not a token id",
        400,
        _completion(logit_bias={"a": 1}),
        says="'a'",
        param="logit_bias",
    ),
    BadInput(
        "`logit_bias` id outside the vocabulary",
        400,
        _completion(logit_bias={"99999999": 1}),
        says="99999999",
        param="logit_bias",
    ),
    BadInput(
        "`logit_bias` over 100", 400, _completion(logit_bias={"5": 101}), says="101", param="logit_bias"
    ),
    BadInput(
        "`allowed_token_ids` empty",
        400,
        _chat(allowed_token_ids=[]),
        path="/v1/chat/completions",
        param="allowed_token_ids",
    ),
    BadInput(
        "`allowed_token_ids` outside the vocabulary",
        400,
        _completion(allowed_token_ids=[1, 99999999]),
        says="99999999",
        param="allowed_token_ids",
    ),
    BadInput("`bad_words` not strings", 400, _completion(bad_words=[3]), param="bad_words.0"),
    BadInput("chat: no messages", 400, _chat(messages=[]), path="/v1/chat/completions", param="messages"),
    BadInput(
        "chat: message without a role",
        400,
        _chat(messages=[{"content": "hi"}]),
        path="/v1/chat/completions",
        param="messages.0.role",
    ),
    BadInput(
        "chat: image content",
        400,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        path="/v1/chat/completions",
        says="only text",
        param="messages",
    ),
    BadInput(
        "chat: `top_logprobs` without `logprobs`",
        400,
        _chat(top_logprobs=2),
        path="/v1/chat/completions",
        param="top_logprobs",
    ),
    BadInput(
        "an invalid JSON schema (`guided_json`)",
        400,
        _completion(guided_json={"type": "nonsense"}),
        says="guided_json is not valid",
        param="guided_json",
    ),
    BadInput(
        "an invalid regex (`structured_outputs.regex`)",
        400,
        _completion(structured_outputs={"regex": "(unclosed"}),
        says="structured_outputs.regex is not valid",
        param="structured_outputs.regex",
    ),
    BadInput(
        "an invalid grammar (`guided_grammar`)",
        400,
        _completion(guided_grammar="root ::= undefined_rule"),
        says="guided_grammar is not valid",
        param="guided_grammar",
    ),
    BadInput(
        "a JSON schema keyword the grammar cannot enforce (`guided_json`)",
        400,
        _completion(
            guided_json={"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
        ),
        says="guided_json: json schema keyword 'uniqueItems' (at properties.tags) is not supported",
        param="guided_json",
    ),
    BadInput(
        "a regex nothing matches (`structured_outputs.regex`)",
        400,
        _completion(structured_outputs={"regex": r"[^\s\S]"}),
        says="structured_outputs.regex is not valid: nothing matches it",
        param="structured_outputs.regex",
    ),
    BadInput(
        "a GBNF grammar nothing matches (llama.cpp's `grammar`)",
        400,
        _completion(grammar=r"root ::= [^\x00-\U0010FFFF]"),
        says="grammar is not valid: nothing matches it",
        param="grammar",
    ),
    BadInput(
        "a schema whose required string has a `pattern` nothing matches",
        400,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {"code": {"type": "string", "pattern": r"[^\s\S]"}},
                        "required": ["code"],
                    },
                },
            }
        ),
        path="/v1/chat/completions",
        says="nothing matches it",
        param="response_format.json_schema.schema",
    ),
    BadInput(
        "llama.cpp's GBNF token references (`grammar`)",
        400,
        _completion(grammar='root ::= <[1000]> "a"'),
        says="grammar is not valid",
        param="grammar",
    ),
    BadInput(
        "`guided_whitespace_pattern` without a JSON constraint",
        400,
        _completion(guided_whitespace_pattern=" ?", regex="a+"),
        says="constrains its output to no JSON",
        param="guided_whitespace_pattern",
    ),
    BadInput(
        "`guided_whitespace_pattern` that matches more than whitespace",
        400,
        _completion(guided_whitespace_pattern="[ x]*", json_schema={"type": "object"}),
        says="guided_whitespace_pattern is not valid: matches more than whitespace",
        param="guided_whitespace_pattern",
    ),
    BadInput(
        "`structured_outputs` with two constraints",
        400,
        _completion(structured_outputs={"regex": "a", "choice": ["a"]}),
        says="needs exactly one of",
        param="structured_outputs",
    ),
    BadInput(
        "two ways of constraining the output at once",
        400,
        _completion(guided_regex="a+", response_format={"type": "json_object"}),
        says="cannot be combined with",
        param="guided_regex",
    ),
    BadInput(
        "a `guided_choice` that is not a list of non-empty strings",
        400,
        _completion(guided_choice=["a", ""]),
        says="guided_choice must be a list of non-empty strings",
        param="guided_choice",
    ),
    BadInput(
        "`response_format` `json_schema` without its schema",
        400,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        path="/v1/chat/completions",
        says="needs json_schema.schema",
        param="response_format.json_schema",
    ),
    BadInput(
        "`response_format` with an invalid schema",
        400,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}),
        path="/v1/chat/completions",
        says="response_format.json_schema.schema is not valid",
        param="response_format.json_schema.schema",
    ),
    BadInput(
        "an unknown `response_format` type",
        400,
        _chat(response_format={"type": "xml"}),
        path="/v1/chat/completions",
        param="response_format.type",
    ),
    BadInput(
        "chat: a tool without its function",
        400,
        _chat(tools=[{"type": "function"}]),
        path="/v1/chat/completions",
        param="tools.0.function",
    ),
    BadInput(
        "chat: a function name outside [a-zA-Z0-9_-]{1,64}",
        400,
        _chat(tools=[{"type": "function", "function": {"name": "no spaces"}}], tool_choice="required"),
        path="/v1/chat/completions",
        param="tools.0.function.name",
    ),
    BadInput(
        "chat: two tools of one name",
        400,
        _chat(tools=[TOOL, TOOL], tool_choice="required"),
        path="/v1/chat/completions",
        says="the name of an earlier tool",
        param="tools.1.function.name",
    ),
    BadInput(
        "chat: a tool whose parameters are not a valid schema (`tool_choice` required)",
        400,
        _chat(
            tools=[TOOL, {"type": "function", "function": {"name": "g", "parameters": {"type": "wat"}}}],
            tool_choice="required",
        ),
        path="/v1/chat/completions",
        says="tools.1.function.parameters is not valid",
        param="tools.1.function.parameters",
    ),
    BadInput(
        "chat: a tool whose parameters are not a valid schema (`tool_choice` none)",
        400,
        _chat(
            tools=[{"type": "function", "function": {"name": "g", "parameters": {"type": "wat"}}}],
            tool_choice="none",
        ),
        path="/v1/chat/completions",
        says="tools.0.function.parameters is not valid",
        param="tools.0.function.parameters",
    ),
    BadInput(
        "chat: a `tool` message without `tool_call_id`",
        400,
        _chat(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "sunny"}]),
        path="/v1/chat/completions",
        says="messages.1.tool_call_id is required",
        param="messages.1.tool_call_id",
    ),
    BadInput(
        "chat: an assistant call whose `arguments` are not the JSON text of an object",
        400,
        _chat(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                        {"id": "d", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
                    ],
                },
            ]
        ),
        path="/v1/chat/completions",
        says="must be the JSON text of an object, got list",
        param="messages.1.tool_calls.1.function.arguments",
    ),
    BadInput(
        "chat: `tool_choice` naming a function not among the tools",
        400,
        _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        path="/v1/chat/completions",
        says="not among the tools",
        param="tool_choice",
    ),
    BadInput(
        "chat: `tool_choice` required without tools",
        400,
        _chat(tool_choice="required"),
        path="/v1/chat/completions",
        says="needs tools",
        param="tool_choice",
    ),
    BadInput(
        "chat: tools with `tool_choice` auto (their default) on a server without a tool call parser",
        400,
        _chat(tools=[TOOL]),
        path="/v1/chat/completions",
        says="--enable-auto-tool-choice",
        param="tool_choice",
    ),
    BadInput(
        "chat: forced tool calls and `response_format` at once",
        400,
        _chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        path="/v1/chat/completions",
        says="response_format cannot be combined with tools",
        param="response_format",
    ),
    BadInput(
        "chat: `functions` (not supported)",
        400,
        _chat(functions=[{"name": "f", "parameters": {}}]),
        path="/v1/chat/completions",
        says="functions is not supported",
        param="functions",
    ),
    BadInput(
        "chat: `function_call` (not supported)",
        400,
        _chat(function_call="auto"),
        path="/v1/chat/completions",
        says="not supported",
        param="function_call",
    ),
    BadInput(
        "chat: `continue_final_message` with `add_generation_prompt` (its default)",
        400,
        _chat(continue_final_message=True),
        path="/v1/chat/completions",
        says="cannot both be true",
        param="continue_final_message",
    ),
    BadInput(
        f"body over the size limit ({MAX_BODY_BYTES} bytes here)",
        413,
        _completion(prompt="x" * MAX_BODY_BYTES),
        says="limit",
    ),
    BadInput(
        "chunked body over the size limit",
        413,
        b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}',
        chunked=True,
        says="limit",
    ),
    BadInput("unknown route", 404, None, path="/v1/embeddings"),
]


def test_a_wrong_method_gets_405_with_allow(base_url):
    response = httpx.get(f"{base_url}/v1/completions", headers=AUTH)
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.what for c in BAD_INPUTS])
def test_bad_input_gets_its_status_and_an_openai_error(case: BadInput, base_url, engine):
    content = case.body if isinstance(case.body, bytes) else None
    if case.chunked:
        content = _chunked(case.body)
    response = httpx.post(
        f"{base_url}{case.path}",
        content=content,
        json=case.body if isinstance(case.body, dict) else None,
        headers=case.headers,
        timeout=30,
    )
    assert response.status_code == case.status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert case.says in error["message"]
    if case.param is not None:
        assert error["param"] == case.param
    wait_idle(base_url)
    assert_pool_whole(engine)


# -- cases that need a server sized for them -------------------------------------------------------
@pytest.fixture(scope="module")
def tight_server():
    app = create_app(EngineConfig(**TIGHT), max_waiting=1)
    with ServerThread(app) as server:
        yield server


def test_a_request_that_can_never_fit_in_the_cache_gets_400(tight_server):
    body = _completion(max_tokens=700)  # within the 1024-token context, over the 640-token cache
    response = httpx.post(f"{tight_server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert "can never fit in the KV cache" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "max_tokens"
    wait_idle(tight_server.base_url)


def test_a_batch_counts_against_the_waiting_limit_by_its_prompts(tight_server):
    """One waiting slot: a request of two prompts can never all wait, even in an empty queue."""
    body = _completion(prompt=["a", "b"])
    response = httpx.post(f"{tight_server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 503
    assert "brings 2 prompts" in response.json()["error"]["message"]
    wait_idle(tight_server.base_url)
    assert_pool_whole(tight_server.app.state.engine.engine)


def test_a_full_waiting_queue_gets_503_and_recovers(tight_server):
    """A runs (held after its first token), B waits: C finds the one waiting slot taken."""
    base_url = tight_server.base_url
    long = _completion(max_tokens=600, ignore_eos=True, stream=True)

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            running = client.stream("POST", "/v1/completions", json=long)
            assert (await running.__aenter__()).status_code == 200
            gate.open_until(lambda outputs: bool(outputs))
            await asyncio.to_thread(gate.holding.wait, 30)
            waiting = client.stream("POST", "/v1/completions", json=long)
            assert (await waiting.__aenter__()).status_code == 200
            metrics = scrape(base_url)
            assert metrics["vllm:num_requests_running"] == 1 and metrics["vllm:num_requests_waiting"] == 1
            refused = await client.post("/v1/completions", json=_completion())
            for stream in (waiting, running):
                await stream.__aexit__(None, None, None)
            return refused

    with EngineGate(tight_server.app.state.engine.engine) as gate:
        gate.close()
        refused = asyncio.run(run())
        wait_idle(base_url)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "queue_full"
    assert httpx.post(f"{base_url}/v1/completions", json=_completion(), timeout=30).status_code == 200
    assert_pool_whole(tight_server.app.state.engine.engine)
