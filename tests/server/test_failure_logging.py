"""Every 5xx is logged exactly once, with the request id its answer carries.

Each test breaks one piece of an in-process server (a handler step, the streaming of an answer,
the engine's admission, the tokenizer route) and reads every ERROR record that the server's and
uvicorn's loggers emit while the request runs: exactly one, naming the id the client got.
"""

from __future__ import annotations

import json
import logging
import re

import httpx
import openai
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from pagedkv.server import prompts as prompts_module
from pagedkv.server.logprobs import LogprobFormatter
from tests.server.helpers import ENGINE_OPTIONS, MODEL, assert_pool_whole, wait_idle

CHAT = [{"role": "user", "content": "hello"}]
REQUEST_ID = re.compile(r"request id ((?:chatcmpl|cmpl|err)-[0-9a-f]+)")


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(EngineConfig(**ENGINE_OPTIONS))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture
def errors(caplog, server):
    """The ERROR records of this test, uvicorn's included (its loggers do not propagate)."""
    uvicorn = logging.getLogger("uvicorn.error")
    uvicorn.addHandler(caplog.handler)
    caplog.set_level(logging.ERROR)
    yield lambda: [r for r in caplog.records if r.levelno >= logging.ERROR]
    uvicorn.removeHandler(caplog.handler)
    wait_idle(server.base_url)
    assert_pool_whole(server.app.state.engine.engine)


def _broken(*_args, **_kwargs):
    raise RuntimeError("secret internals")


def _logged_once(records: list[logging.LogRecord], request_id: str) -> None:
    assert len(records) == 1, [r.getMessage() for r in records]
    assert request_id in records[0].getMessage()
    assert records[0].exc_info is not None  # the traceback is in the log, not in the answer


def test_a_handler_bug_before_generation(client, errors, monkeypatch):
    monkeypatch.setattr(prompts_module, "check_context", _broken)  # on the tokenizer thread
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    message = failed.value.body["message"]
    request_id = REQUEST_ID.search(message).group(1)
    assert request_id.startswith("chatcmpl-") and "secret" not in message
    _logged_once(errors(), request_id)


def test_a_failure_while_building_a_whole_answer(client, errors, monkeypatch):
    monkeypatch.setattr(LogprobFormatter, "chat", _broken)
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True)
    _logged_once(errors(), REQUEST_ID.search(failed.value.body["message"]).group(1))


def test_a_failure_while_streaming(server, errors, monkeypatch):
    monkeypatch.setattr(LogprobFormatter, "chat", _broken)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "logprobs": True, "stream": True}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200  # the stream had started
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    first, error = json.loads(events[0]), json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and error["code"] == "internal_error"
    assert REQUEST_ID.search(error["message"]).group(1) == first["id"]
    _logged_once(errors(), first["id"])


def test_a_failure_of_the_engine_admitting_the_request(server, client, errors, monkeypatch):
    monkeypatch.setattr(server.app.state.engine.engine, "add_request", _broken)
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    request_id = REQUEST_ID.search(failed.value.body["message"]).group(1)
    assert request_id.startswith("cmpl-")
    _logged_once(errors(), request_id)


def test_a_bug_in_a_route_without_a_request_id(server, errors, monkeypatch):
    monkeypatch.setattr(server.app.state.context.encoder, "encode_text", _broken)
    response = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hi"}, timeout=30)
    assert response.status_code == 500
    request_id = REQUEST_ID.search(response.json()["error"]["message"]).group(1)
    assert request_id.startswith("err-") and response.headers["x-content-type-options"] == "nosniff"
    _logged_once(errors(), request_id)


def test_a_full_queue_is_a_warning_with_the_id(caplog):
    with ServerThread(create_app(EngineConfig(**ENGINE_OPTIONS), max_waiting=0)) as full:
        with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
            response = httpx.post(
                f"{full.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30
            )
    assert response.status_code == 503 and response.json()["error"]["code"] == "queue_full"
    request_id = REQUEST_ID.search(response.json()["error"]["message"]).group(1)
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.levelno, request_id in r.getMessage()) for r in records] == [(logging.WARNING, True)]
