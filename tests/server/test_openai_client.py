"""The official ``openai`` client against a real server: completions, chat, streaming, options.

Every generated text is compared with ``LLM.generate`` on the same prompt and parameters.
"""

from __future__ import annotations

import math

import pytest

from pagedkv import SamplingParams
from tests.server.helpers import MODEL, prompts

pytestmark = pytest.mark.usefixtures("leaves_server_idle")


def _generate(reference, prompt, **params):
    return reference.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_models_lists_the_served_model(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == engine.max_model_len


def test_completion_equals_llm_generate_with_seed(client, reference):
    prompt = prompts(1, seed=1)[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, seed=7)
    expected = _generate(reference, prompt, max_tokens=12, temperature=0.8, seed=7)
    [choice] = response.choices
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.model == MODEL and response.object == "text_completion"


def test_n_samples_and_a_batch_of_prompts(client, reference):
    batch = prompts(2, seed=2)
    response = client.completions.create(
        model=MODEL, prompt=batch, max_tokens=8, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    params = SamplingParams(max_tokens=8, n=2, seed=3, ignore_eos=True)
    expected = reference.generate(batch, params, use_tqdm=False)
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert texts == [s.text for out in expected for s in out.outputs]
    assert response.usage.completion_tokens == 2 * 2 * 8


def test_completion_logprobs_match_the_engine(client, reference):
    prompt = prompts(1, seed=4)[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=3, temperature=0)
    expected = _generate(reference, prompt, max_tokens=6, logprobs=3, temperature=0).outputs[0]
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for top, entry in zip(logprobs.top_logprobs, expected.logprobs, strict=True):
        assert 3 <= len(top) <= 4  # the top 3 plus the sampled token
        assert max(top.values()) == pytest.approx(entry.top[0][1], abs=1e-4)


def test_chat_uses_the_model_chat_template(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a block?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, seed=5)
    ids = reference.tokenizer.encode_chat(messages)
    expected = _generate(reference, ids, max_tokens=10, seed=5)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(ids)


def test_chat_without_max_tokens_runs_to_the_context_or_eos(client):
    messages = [{"role": "user", "content": "hi"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, seed=0)
    usage = response.usage
    assert response.choices[0].finish_reason in ("stop", "length")
    if response.choices[0].finish_reason == "length":
        assert usage.total_tokens == 256  # max_model_len
    assert usage.completion_tokens >= 1


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "tokens"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.logprob <= 0 and not math.isnan(token.logprob)
        # greedy: the sampled token is the most likely one
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(token.bytes).decode() == token.token


def test_streamed_completion_equals_the_whole_one(client, reference):
    prompt = prompts(1, seed=6)[0]
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=14, seed=9, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    expected = _generate(reference, prompt, max_tokens=14, seed=9).outputs[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert len(chunks) > 2  # really streamed, not one blob
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_streamed_chat_with_n(client, reference):
    messages = [{"role": "user", "content": "stream two answers"}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        n=2,
        seed=11,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts, roles, finish = ["", ""], set(), {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add((choice.index, choice.delta.role))
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    expected = _generate(
        reference, reference.tokenizer.encode_chat(messages), max_tokens=8, n=2, seed=11, ignore_eos=True
    )
    assert texts == [s.text for s in expected.outputs]
    assert roles == {(0, "assistant"), (1, "assistant")}
    assert finish == {0: "length", 1: "length"}


def test_stop_string_cuts_streamed_and_whole_text_alike(client, reference):
    prompt = prompts(1, seed=8)[0]
    free = _generate(reference, prompt, max_tokens=16, seed=1, ignore_eos=True).outputs[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # certainly generated, mid-way
    options = dict(
        model=MODEL, prompt=prompt, max_tokens=16, seed=1, stop=[stop], extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**options)
    streamed = client.completions.create(**options, stream=True)
    streamed_text = "".join(c.choices[0].text for c in streamed)
    expected = free[: free.find(stop)]
    assert whole.choices[0].text == streamed_text == expected
    assert whole.choices[0].finish_reason == "stop"


# -- vLLM's prompt_logprobs: per prompt token a map token id -> {logprob, rank, decoded_token},
# None first; once per choice (on its first chunk when streaming); the engine's numbers.
def _check_prompt_logprobs(choice_prompt_logprobs, expected, tokenizer) -> None:
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
        _check_prompt_logprobs(
            choice.model_extra["prompt_logprobs"], expected.prompt_logprobs, reference.tokenizer
        )


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
    _check_prompt_logprobs(chunks[0], expected.prompt_logprobs, reference.tokenizer)
    assert all(later is None for later in chunks[1:]) and len(chunks) > 1


def test_without_the_parameter_there_are_none(client):
    response = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=2)
    assert response.choices[0].model_extra.get("prompt_logprobs") is None
