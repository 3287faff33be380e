"""A vLLM user's first requests against the real model (SmolLM2-135M-Instruct), over real HTTP
with the official ``openai`` client: a chat answer, ``/tokenize`` and ``/detokenize`` round
trips through its GPT-2 BPE, and tenants kept apart by ``cache_salt`` in the prefix cache.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.real_model import ENGINE_OPTIONS, MODEL_NAME
from tests.server.helpers import assert_pool_whole, scrape, wait_idle

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
#: Text a byte-level BPE must carry through unchanged: accents, CJK, an emoji, a tab, spaces.
ROUND_TRIP = "Grüße aus Köln — 東京 ok 🚀\tend  two spaces"
#: Several full blocks of 16 tokens, and sent by no other test.
SHARED_PREFIX = "Summarise this policy for a new employee. " + " ".join(
    f"Rule {i}: keep the shared blocks of tenant data apart." for i in range(10)
)


@pytest.fixture(scope="module")
def server(real_model):
    app = create_app(EngineConfig(model=str(real_model), **ENGINE_OPTIONS), served_model_name=MODEL_NAME)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(autouse=True)
def _leaves_server_idle(server):
    yield
    wait_idle(server.base_url)
    assert_pool_whole(server.app.state.engine.engine)


def test_chat_answers_the_question(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=20, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tokenize_and_detokenize_round_trip(server):
    tokens = httpx.post(
        f"{server.base_url}/tokenize", json={"model": MODEL_NAME, "prompt": ROUND_TRIP}
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.base_url}/detokenize", json={"model": MODEL_NAME, "tokens": tokens["tokens"]})
    assert text.json()["prompt"] == ROUND_TRIP


def test_a_tokenized_conversation_is_the_prompt_chat_runs(client, server):
    body = {"model": MODEL_NAME, "messages": QUESTION, "add_generation_prompt": True}
    tokens = httpx.post(f"{server.base_url}/tokenize", json=body).json()
    reply = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=1)
    assert tokens["count"] == reply.usage.prompt_tokens
    shown = httpx.post(
        f"{server.base_url}/detokenize", json={"model": MODEL_NAME, "tokens": tokens["tokens"]}
    )
    assert shown.json()["prompt"].endswith("<|im_start|>assistant\n")  # ChatML's open answer


def _hit_tokens(client, server, salt: str | None) -> float:
    before = scrape(server.base_url)["vllm:prefix_cache_hits_total"]
    extra = {} if salt is None else {"cache_salt": salt}
    client.completions.create(
        model=MODEL_NAME, prompt=SHARED_PREFIX, max_tokens=2, temperature=0, extra_body=extra
    )
    wait_idle(server.base_url)
    return scrape(server.base_url)["vllm:prefix_cache_hits_total"] - before


def test_cache_salts_keep_tenants_prefix_caches_apart(client, server):
    hits = [_hit_tokens(client, server, salt) for salt in ("tenant-a", "tenant-b", "tenant-a", None)]
    assert hits[0] == 0 and hits[1] == 0  # nothing cached before, nothing shared across salts
    assert hits[2] >= 64  # tenant-a finds its own blocks (the prompt spans well over 4 blocks)
    assert hits[3] == 0  # an unsalted request finds no salted block
