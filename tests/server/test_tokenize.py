"""``/tokenize``, ``/detokenize`` and ``/version`` (vLLM's routes) on the built-in model's server.

A tokenized conversation must be exactly the prompt the chat route runs: its ``count`` is checked
against the ``usage.prompt_tokens`` of the same chat through the official client.
"""

from __future__ import annotations

import json

import httpx
import pytest

import pagedkv
from tests.server.helpers import API_KEY, MODEL, assert_pool_whole, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "How do paged caches share blocks?"},
]


def _post(base_url: str, route: str, body: dict) -> httpx.Response:
    """POST ``body`` as ASCII JSON (which can carry an unpaired surrogate, as ``\\ud800``)."""
    content = json.dumps({"model": MODEL, **body})
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(f"{base_url}{route}", content=content, headers=headers, timeout=30)


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_text_round_trips_through_ids(base_url, reference):
    text = "paged attention keeps the cache in blocks"
    plain = _ok(_post(base_url, "/tokenize", {"prompt": text, "add_special_tokens": False}))
    assert plain["tokens"] == reference.tokenizer.encode(text, add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 256
    assert plain["token_strs"] is None
    assert _ok(_post(base_url, "/detokenize", {"tokens": plain["tokens"]})) == {"prompt": text}
    # By default a prompt gets the special tokens, which detokenize keeps (as vLLM does).
    with_bos = _ok(_post(base_url, "/tokenize", {"prompt": text}))
    assert with_bos["tokens"] == [reference.tokenizer.bos_token_id, *plain["tokens"]]
    assert (
        _ok(_post(base_url, "/detokenize", {"tokens": with_bos["tokens"]}))["prompt"]
        == "<|begin_of_text|>" + text
    )


def test_token_strs_are_the_vocabulary_strings(base_url, reference):
    answer = _ok(_post(base_url, "/tokenize", {"prompt": "hello world", "return_token_strs": True}))
    backend = reference.tokenizer.backend
    assert answer["token_strs"] == [backend.id_to_token(i) for i in answer["tokens"]]
    assert answer["token_strs"][0] == "<|begin_of_text|>" and "Ġw" in answer["token_strs"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_special_tokens": True},
    ],
)
def test_a_tokenized_chat_is_the_prompt_the_chat_runs(base_url, client, engine, options):
    tokenized = _ok(_post(base_url, "/tokenize", {"messages": CHAT, **options}))
    rendered = _ok(_post(base_url, "/v1/chat/completions/render", {"messages": CHAT, **options}))
    assert tokenized["tokens"] == rendered["token_ids"]
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=options)
    assert response.usage.prompt_tokens == tokenized["count"]
    wait_idle(base_url)
    assert_pool_whole(engine)


def test_tools_reach_the_template_as_in_chat(base_url):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    without = _ok(_post(base_url, "/tokenize", {"messages": CHAT}))
    with_tools = _ok(_post(base_url, "/tokenize", {"messages": CHAT, "tools": [tool]}))
    chat = {"messages": CHAT, "tools": [tool], "tool_choice": "none"}
    rendered = _ok(_post(base_url, "/v1/chat/completions/render", chat))
    assert with_tools["tokens"] == rendered["token_ids"] and with_tools["count"] > without["count"]


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("/detokenize", {"tokens": [1, 99999]}, "tokens", "tokens[1] = 99999"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "tokens[0] = -1"),
        ("/detokenize", {"tokens": ["1"]}, "tokens.0", "valid integer"),
        ("/tokenize", {}, "prompt", "exactly one"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", "exactly one"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt", "messages"),
        ("/tokenize", {"messages": []}, "messages", "at least 1"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt", "surrogate"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", "does not exist"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ 'x' }}"}, "chat_template", "trust"),
        (
            "/tokenize",
            {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
            "passes it to the template itself",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(base_url, route, body, param, words):
    response = _post(base_url, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_the_tokenizer_routes_need_the_key_version_does_not(base_url):
    for route in ("/tokenize", "/detokenize"):
        response = httpx.post(f"{base_url}{route}", json={"prompt": "a", "tokens": [1]}, timeout=30)
        assert response.status_code == 401
    response = httpx.get(f"{base_url}/version", timeout=30)
    assert response.status_code == 200 and response.json() == {"version": pagedkv.__version__}


def test_openapi_lists_the_routes(base_url):
    paths = httpx.get(f"{base_url}/openapi.json", timeout=30).json()["paths"]
    assert {"/tokenize", "/detokenize", "/version"} <= set(paths)
    assert "400" in paths["/tokenize"]["post"]["responses"]
