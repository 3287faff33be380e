"""Chat templates chosen per server and per request: ``--chat-template``, a request's
``chat_template`` (with ``--trust-request-chat-template``) and ``chat_template_kwargs``.

Every template here writes a text whose ids the test knows, so each assertion compares the prompt
the server ran (``usage.prompt_tokens``, the render route's ids) and the answer (``LLM.generate``
on those ids) with what that template must produce.
"""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest

from pagedkv import SamplingParams
from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from pagedkv.server.cli import add_serve_parser, app_options, chat_template, read_chat_template
from tests.server.helpers import API_KEY, ENGINE_OPTIONS, MODEL
from tests.server.process import ServeProcess

#: Writes the contents one after the other, then "!!!" when the template variable ``shout`` is set.
SHOUTING = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if shout %}!!!{% endif %}"
MESSAGES = [{"role": "user", "content": "paged"}, {"role": "assistant", "content": "blocks"}]


@pytest.fixture(scope="module")
def trusting():
    """A server that accepts a request's own chat template."""
    app = create_app(EngineConfig(**ENGINE_OPTIONS), trust_request_chat_template=True)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(trusting):
    with openai.OpenAI(base_url=f"{trusting.base_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def _ids(reference, text: str) -> list[int]:
    return reference.tokenizer.encode(text, add_special_tokens=False)


def _rendered(base_url: str, body: dict, headers: dict | None = None) -> list[int]:
    response = httpx.post(
        f"{base_url}/v1/chat/completions/render", json={"model": MODEL, **body}, headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()["token_ids"]


def test_a_requests_template_replaces_the_models(trusting, client, reference):
    expected = _ids(reference, "<|begin_of_text|>paged|blocks|")
    assert _rendered(trusting.base_url, {"messages": MESSAGES, "chat_template": SHOUTING}) == expected
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, extra_body={"chat_template": SHOUTING}
    )
    assert response.usage.prompt_tokens == len(expected)
    answer = reference.generate([expected], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert response.choices[0].message.content == answer[0].outputs[0].text


def test_template_kwargs_reach_the_template(trusting, client, reference):
    body = {"messages": MESSAGES, "chat_template": SHOUTING}
    quiet = _rendered(trusting.base_url, body)
    loud = _rendered(trusting.base_url, {**body, "chat_template_kwargs": {"shout": True}})
    assert loud == _ids(reference, "<|begin_of_text|>paged|blocks|!!!") and loud != quiet
    extra = {"chat_template": SHOUTING, "chat_template_kwargs": {"shout": True}}
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert response.usage.prompt_tokens == len(loud)


@pytest.mark.parametrize(
    "key", ["messages", "add_generation_prompt", "tools", "chat_template", "raise_exception"]
)
def test_kwargs_that_would_override_the_servers_arguments_are_refused(client, key):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"chat_template_kwargs": {key: None}}
        )
    error = refused.value.body
    assert error["param"] == f"chat_template_kwargs.{key}" and repr(key) in error["message"]


@pytest.mark.parametrize(
    ("template", "param"),
    [
        ("{% for %}", "chat_template"),
        ("{{ 1 / 0 }}", "messages"),
        ("{{ raise_exception('no') }}", "messages"),
    ],
)
def test_a_template_that_fails_is_a_400(client, template, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"chat_template": template}
        )
    assert refused.value.body["param"] == param


def test_a_server_that_does_not_trust_requests_refuses_their_template(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as untrusting:
        with pytest.raises(openai.BadRequestError) as refused:
            untrusting.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"chat_template": SHOUTING}
            )
    assert refused.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.value.body["message"]


# -- --chat-template ---------------------------------------------------------------------------
def _serve_args(*options: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *options])


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(SHOUTING)
    assert read_chat_template(str(path)) == SHOUTING
    assert read_chat_template(SHOUTING) == SHOUTING
    with pytest.raises(ValueError, match="neither a readable file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    options = app_options(_serve_args("--chat-template", str(path), "--reasoning-parser", "qwen3"))
    assert options["chat_template"] == SHOUTING and options["reasoning_parser"] == "qwen3"
    assert options["trust_request_chat_template"] is False


@pytest.mark.parametrize("value", ["{% for %}", "no-such-file.jinja"])
def test_serve_refuses_a_chat_template_it_cannot_use(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        chat_template(_serve_args("--chat-template", value))
    assert exit_info.value.code == 2 and "--chat-template" in capsys.readouterr().err


def test_serve_with_a_chat_template_file_runs_it(tmp_path, reference):
    path = tmp_path / "template.jinja"
    path.write_text(SHOUTING)
    with ServeProcess(
        "--num-kv-blocks", "32", "--max-model-len", "128", "--chat-template", str(path)
    ) as server:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        answer = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()
        tokenized = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()
    expected = _ids(reference, "<|begin_of_text|>paged|blocks|")
    assert tokenized["tokens"] == expected
    assert answer["usage"]["prompt_tokens"] == len(expected)
