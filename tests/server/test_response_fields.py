"""vLLM's response-shaping fields through the official ``openai`` client, and unknown fields.

``return_tokens_as_token_ids``, chat ``prompt_logprobs``, ``stream_options.continuous_usage_stats``
each checked against the engine (``LLM.generate``); a body's unknown fields accepted but named,
in a warning with the request's id and in the ``x-pagedkv-ignored-fields`` header.
"""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from pagedkv import SamplingParams
from pagedkv.server.ignored_fields import HEADER
from tests.server.helpers import API_KEY, MODEL, prompts

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Which blocks does a request hold?"}]


pytestmark = pytest.mark.usefixtures("leaves_server_idle")


def _chat_prompt(base_url: str) -> list[int]:
    body = {"model": MODEL, "messages": CHAT}
    response = httpx.post(f"{base_url}/v1/chat/completions/render", json=body, headers=AUTH, timeout=30)
    return response.json()["token_ids"]


# -- return_tokens_as_token_ids ----------------------------------------------------------------
def test_completion_logprob_tokens_are_token_ids(client, reference):
    prompt = prompts(1, seed=31)[0]
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    expected = reference.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=2), use_tqdm=False
    )[0].outputs[0]
    logprobs = response.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{t}" for t in expected.token_ids]
    for top, entry in zip(logprobs.top_logprobs, expected.logprobs, strict=True):
        assert set(top) == {f"token_id:{t}" for t, _ in entry.top} | {f"token_id:{entry.token_id}"}
    texts = [reference.tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    assert logprobs.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


def test_chat_logprob_tokens_are_token_ids(client, base_url, reference):
    response = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    expected = reference.generate(
        [_chat_prompt(base_url)], SamplingParams(max_tokens=4, temperature=0, logprobs=2), use_tqdm=False
    )[0].outputs[0]
    content = response.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in expected.token_ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(top.token.startswith("token_id:") for c in content for top in c.top_logprobs)
    plain = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True
    )
    assert plain.choices[0].logprobs.content[0].token == reference.tokenizer.decode([expected.token_ids[0]])


# -- chat prompt_logprobs ----------------------------------------------------------------------
def test_chat_prompt_logprobs_are_the_engines(client, base_url, reference):
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    prompt = _chat_prompt(base_url)
    expected = reference.generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1), use_tqdm=False
    )[0].prompt_logprobs
    got = response.model_extra["prompt_logprobs"]
    assert len(got) == len(prompt) == response.usage.prompt_tokens and got[0] is None
    for position, token_id, entry in zip(got[1:], prompt[1:], expected[1:], strict=True):
        assert list(position)[0] == str(token_id)
        assert position[str(token_id)]["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert position[str(token_id)]["rank"] == entry.rank
    without = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert without.model_extra.get("prompt_logprobs") is None


def test_chat_prompt_logprobs_are_refused_when_streaming(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert refused.value.body["param"] == "prompt_logprobs"


# -- stream_options.continuous_usage_stats -----------------------------------------------------
def _check_running_usage(chunks, prompt_tokens: int) -> None:
    """Every chunk has the usage so far; the last one (the usage chunk) the whole."""
    usages = [chunk.usage for chunk in chunks]
    assert all(u is not None and u.prompt_tokens == prompt_tokens for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)


def test_completion_chunks_carry_the_usage_so_far(client, reference):
    prompt = prompts(1, seed=32)[0]
    options = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    usage = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(**options, stream=True, stream_options=usage))
    whole = client.completions.create(**options)
    _check_running_usage(chunks, whole.usage.prompt_tokens)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 6
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[-1].usage.completion_tokens == 6  # the last text chunk counts every token
    plain = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_stream_options_without_stream_are_refused(client):
    with pytest.raises(openai.BadRequestError) as refused:
        usage = {"include_usage": True}
        client.completions.create(model=MODEL, prompt="a", max_tokens=1, stream_options=usage)
    assert refused.value.body["param"] == "stream_options"


def test_chat_chunks_carry_the_usage_so_far(client):
    options = dict(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    usage = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(**options, stream=True, stream_options=usage))
    whole = client.chat.completions.create(**options)
    _check_running_usage(chunks, whole.usage.prompt_tokens)
    assert chunks[0].usage.completion_tokens == 0  # the role chunk: nothing generated yet
    assert chunks[-1].usage.completion_tokens == 5


# -- unknown fields ----------------------------------------------------------------------------
def test_unknown_fields_are_named_in_a_header_and_the_log(client, caplog):
    unknown = {"max_token": 5, "frobnicate": True}
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body=unknown
        )
        response = raw.parse()
        streamed = client.completions.with_raw_response.create(
            model=MODEL, prompt="def", max_tokens=2, stream=True, extra_body=unknown
        )
        chunks = list(streamed.parse())
    assert raw.headers[HEADER] == "frobnicate, max_token" == streamed.headers[HEADER]
    warnings = [r.getMessage() for r in caplog.records if "were ignored" in r.getMessage()]
    assert len(warnings) == 2 and response.id in warnings[0] and chunks[0].id in warnings[1]
    assert all("frobnicate, max_token" in w for w in warnings)


def test_declared_fields_are_not_unknown(client, base_url):
    vllm_fields = {"top_k": 2, "use_beam_search": False, "return_tokens_as_token_ids": False}
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="a", max_tokens=1, extra_body=vllm_fields
    )
    assert HEADER not in raw.headers
    body = {"model": MODEL, "prompt": "a", "add_special_tokens": False, "colour": "red"}
    tokenized = httpx.post(f"{base_url}/tokenize", json=body, headers=AUTH, timeout=30)
    assert tokenized.status_code == 200 and tokenized.headers[HEADER] == "colour"


def test_unknown_names_are_escaped_and_counted(client):
    unknown = {f"field{i:02d}": i for i in range(20)} | {"bad\nname": 1}
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="a", max_tokens=1, extra_body=unknown
    )
    listed = raw.headers[HEADER]
    assert listed.startswith("bad\\nname, field00, ") and listed.endswith(", ... (5 more)")


def test_names_with_spaces_at_their_ends_keep_the_header_legal(client):
    """A header value may not begin or end with a space: such a name, listed as it is, made the
    response impossible to send (the client saw the connection close without an answer)."""
    unknown = {' ""': 1, "a b ": 2, " ": 3, "del\x7f": 4}
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="a", max_tokens=1, extra_body=unknown
    )
    assert raw.status_code == 200
    assert raw.headers[HEADER] == '\\u0020, \\u0020\\"\\", a b\\u0020, del\\u007f'
