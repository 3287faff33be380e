"""vLLM's ``prompt_logprobs`` on ``/v1/completions`` through the real ``openai`` client.

The numbers must be the engine's (``LLM.generate`` with the same parameters), in vLLM's shape:
per prompt token a map from token id to ``{logprob, rank, decoded_token}``, None first; once per
choice, on its first chunk when streaming.
"""

from __future__ import annotations

import openai
import pytest

from pagedkv import SamplingParams
from tests.server.helpers import API_KEY, MODEL, assert_pool_whole, prompts, wait_idle


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(autouse=True)
def _leaves_server_idle(base_url, engine):
    yield
    wait_idle(base_url)
    assert_pool_whole(engine)


def _check(choice_prompt_logprobs, expected, tokenizer) -> None:
    assert len(choice_prompt_logprobs) == len(expected) and choice_prompt_logprobs[0] is None
    for position, entry in zip(choice_prompt_logprobs[1:], expected[1:], strict=True):
        candidates = [(entry.token_id, entry.logprob, entry.rank)]
        candidates += [(t, lp, rank) for rank, (t, lp) in enumerate(entry.top, start=1)]
        assert list(position) == list(dict.fromkeys(str(t) for t, _, _ in candidates))  # own token first
        for token_id, logprob, rank in candidates:
            got = position[str(token_id)]
            assert got["logprob"] == pytest.approx(logprob, abs=1e-4) and got["rank"] == rank
            assert got["decoded_token"] == tokenizer.decode([token_id], skip_special_tokens=False)


def test_prompt_logprobs_equal_the_engine_for_every_choice(client, reference):
    prompt = prompts(1, seed=11)[0]
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, n=2, seed=1, extra_body={"prompt_logprobs": 2}
    )
    expected = reference.generate(
        [prompt], SamplingParams(max_tokens=3, n=2, seed=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    assert len(response.choices) == 2
    for choice in response.choices:
        _check(choice.model_extra["prompt_logprobs"], expected.prompt_logprobs, reference.tokenizer)


def test_streaming_sends_them_on_each_choices_first_chunk_only(client, reference):
    prompt = prompts(1, seed=12)[0]
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"prompt_logprobs": 2},
    )
    chunks = [chunk.choices[0].model_extra.get("prompt_logprobs") for chunk in stream if chunk.choices]
    expected = reference.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2), use_tqdm=False
    )[0]
    _check(chunks[0], expected.prompt_logprobs, reference.tokenizer)
    assert all(later is None for later in chunks[1:]) and len(chunks) > 1


def test_without_the_parameter_there_are_none(client):
    response = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=2)
    assert response.choices[0].model_extra.get("prompt_logprobs") is None
