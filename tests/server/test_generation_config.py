"""The model's sampling defaults on the server, through the official ``openai`` client.

SmolLM2's generation_config.json is given ``"temperature": 0.0`` and ``"max_new_tokens": 6``.
With the default ``--generation-config auto`` a request that leaves ``temperature`` unset is
greedy -- the same answer whatever its seed -- and a chat without ``max_tokens`` stops at 6
tokens; a field the request sets wins. With ``--generation-config vllm`` the file is ignored:
an unset temperature is 1.0 again.
"""

from __future__ import annotations

import json

import openai
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.real_model import MODEL_NAME, copy_of_real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = copy_of_real_model(tmp_path_factory.mktemp("smollm2"))
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "temperature": 0.0, "max_new_tokens": 6}))
    return folder


def _client(model_folder, generation_config: str):
    config = EngineConfig(
        model=str(model_folder), num_kv_blocks=64, max_model_len=512, generation_config=generation_config
    )
    return ServerThread(create_app(config))


@pytest.fixture(scope="module")
def auto(model_folder):
    with _client(model_folder, "auto") as server:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as client:
            yield client


@pytest.fixture(scope="module")
def vllm(model_folder):
    with _client(model_folder, "vllm") as server:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as client:
            yield client


def _chat(client, **fields):
    response = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, **fields)
    return response.choices[0]


def test_an_unset_temperature_takes_the_models_greedy_default(auto):
    unset = [_chat(auto, max_tokens=8, seed=seed).message.content for seed in (1, 2)]
    greedy = _chat(auto, max_tokens=8, temperature=0.0).message.content
    assert unset == [greedy, greedy]
    completion = auto.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, seed=1)
    explicit = auto.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0)
    assert completion.choices[0].text == explicit.choices[0].text


def test_the_requests_own_temperature_wins(auto):
    greedy = _chat(auto, max_tokens=8, temperature=0.0).message.content
    sampled = _chat(auto, max_tokens=8, temperature=1.0, seed=1).message.content
    assert sampled != greedy


def test_max_new_tokens_is_the_chat_default_max_tokens(auto):
    capped = _chat(auto)
    assert capped.finish_reason == "length"
    assert auto.chat.completions.create(model=MODEL_NAME, messages=QUESTION).usage.completion_tokens == 6
    longer = auto.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=7)
    assert longer.usage.completion_tokens == 7  # an explicit max_tokens wins (the answer has 8)


def test_generation_config_vllm_restores_temperature_one(vllm, auto):
    unset = _chat(vllm, max_tokens=8, seed=1).message.content
    assert unset == _chat(vllm, max_tokens=8, seed=1, temperature=1.0).message.content
    assert unset != _chat(vllm, max_tokens=8, temperature=0.0).message.content
    assert unset != _chat(auto, max_tokens=8, seed=1).message.content  # auto: greedy
