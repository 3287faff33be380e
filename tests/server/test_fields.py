"""vLLM's request fields through the official ``openai`` client, each field's effect asserted.

Completions ``echo`` (with logprobs, and ``max_tokens`` 0), ``truncate_prompt_tokens``,
``skip_special_tokens``; chat ``add_generation_prompt``, ``continue_final_message`` and
``echo``; fields that are not implemented refused with a 400 naming them; the render routes
giving the ids the generation routes run. Every generated text is compared with ``LLM.generate``.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from pagedkv import SamplingParams
from tests.server.helpers import API_KEY, MODEL, prompts

AUTH = {"Authorization": f"Bearer {API_KEY}"}


pytestmark = pytest.mark.usefixtures("leaves_server_idle")


def _generate(reference, prompt, **params):
    return reference.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def _render(base_url: str, route: str, body: dict) -> list[int] | list[list[int]]:
    response = httpx.post(f"{base_url}{route}", json={"model": MODEL, **body}, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    rendered = response.json()
    return [r["token_ids"] for r in rendered] if isinstance(rendered, list) else rendered["token_ids"]


# -- completions: echo -------------------------------------------------------------------------
def test_echo_prepends_each_prompt_to_its_choices(client, reference):
    batch = prompts(2, seed=21)
    response = client.completions.create(model=MODEL, prompt=batch, max_tokens=6, n=2, seed=4, echo=True)
    expected = reference.generate(batch, SamplingParams(max_tokens=6, n=2, seed=4), use_tqdm=False)
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert texts == [
        prompt + s.text for prompt, out in zip(batch, expected, strict=True) for s in out.outputs
    ]
    assert response.usage.completion_tokens == sum(len(s.token_ids) for out in expected for s in out.outputs)


def test_streamed_echo_sends_the_prompt_once_at_the_start(client):
    prompt = prompts(1, seed=22)[0]
    options = dict(model=MODEL, prompt=prompt, max_tokens=8, seed=2, echo=True)
    whole = client.completions.create(**options).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(**options, stream=True)]
    assert chunks[0].startswith(prompt) and "".join(chunks) == whole
    assert whole.startswith(prompt) and whole.count(prompt) == 1


def test_echo_of_token_ids_decodes_them(client, reference):
    ids = reference.tokenizer.encode("ids in, text out")
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    decoded = reference.tokenizer.decode(ids, skip_special_tokens=False)
    assert decoded.startswith("<|begin_of_text|>")
    expected = _generate(reference, ids, max_tokens=4, temperature=0).outputs[0]
    assert response.choices[0].text == decoded + expected.text


def test_echo_with_logprobs_starts_with_the_prompt_tokens(client, reference):
    prompt = prompts(1, seed=23)[0]
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2
    )
    expected = _generate(reference, prompt, max_tokens=5, temperature=0, logprobs=2, prompt_logprobs=2)
    logprobs = response.choices[0].logprobs
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs.tokens) == num_prompt + 5
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    got = logprobs.token_logprobs[1:]
    want = [e.logprob for e in expected.prompt_logprobs[1:]] + [
        e.logprob for e in expected.outputs[0].logprobs
    ]
    assert got == pytest.approx(want, abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])  # top 2 plus the token itself
    tokens = [reference.tokenizer.decode([t], skip_special_tokens=False) for t in expected.prompt_token_ids]
    assert logprobs.tokens[:num_prompt] == tokens
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]


def test_echo_with_max_tokens_0_answers_the_prompt_alone(client, reference):
    prompt = prompts(1, seed=24)[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    [choice] = response.choices
    assert choice.text == prompt
    expected = _generate(reference, prompt, max_tokens=1, prompt_logprobs=0)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [e.logprob for e in expected.prompt_logprobs[1:]], abs=1e-4
    )
    assert len(choice.logprobs.tokens) == len(expected.prompt_token_ids)


# -- completions: truncate_prompt_tokens, skip_special_tokens ---------------------------------
@pytest.mark.parametrize("as_ids", [False, True])
def test_truncate_prompt_tokens_keeps_the_last_tokens(client, reference, base_url, as_ids):
    text = " ".join(prompts(6, seed=25))
    ids = reference.tokenizer.encode(text)
    assert len(ids) > 20
    prompt = ids if as_ids else text
    extra = {"truncate_prompt_tokens": 20, "ignore_eos": True}
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, seed=3, extra_body=extra)
    expected = _generate(reference, ids[-20:], max_tokens=6, seed=3, ignore_eos=True).outputs[0]
    assert response.usage.prompt_tokens == 20
    assert response.choices[0].text == expected.text
    rendered = _render(base_url, "/v1/completions/render", {"prompt": prompt, "truncate_prompt_tokens": 20})
    assert rendered == [ids[-20:]]


def test_truncate_prompt_tokens_minus_one_keeps_what_fits_beside_max_tokens(client, reference):
    ids = reference.tokenizer.encode(" ".join(prompts(40, seed=26)))
    assert len(ids) > 256  # over the whole context: refused without truncation
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    extra = {"truncate_prompt_tokens": -1}
    response = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body=extra
    )
    assert response.usage.prompt_tokens == 256 - 6
    expected = _generate(reference, ids[-250:], max_tokens=6, temperature=0).outputs[0]
    assert response.choices[0].text == expected.text


def test_skip_special_tokens_false_shows_their_text(client, reference):
    """Seeded samples that draw special tokens (end and begin of a file) show their text only
    when asked; the tokens are the same either way."""
    prompt = "def f(x):\n    return x\n"
    drawn = dict(n=16, max_tokens=64, temperature=1.0, seed=0, ignore_eos=True)
    expected = _generate(reference, prompt, **drawn, skip_special_tokens=False)
    specials = ("<|end_of_text|>", "<|begin_of_text|>")
    assert any(s in c.text for c in expected.outputs for s in specials)
    options = dict(model=MODEL, prompt=prompt, max_tokens=64, n=16, temperature=1.0, seed=0)
    shown = client.completions.create(
        **options, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    hidden = client.completions.create(**options, extra_body={"ignore_eos": True})
    shown_texts = [c.text for c in sorted(shown.choices, key=lambda c: c.index)]
    hidden_texts = [c.text for c in sorted(hidden.choices, key=lambda c: c.index)]
    assert shown_texts == [c.text for c in expected.outputs]
    assert not any(s in text for text in hidden_texts for s in specials)
    for with_special, without in zip(shown_texts, hidden_texts, strict=True):
        assert with_special.replace(specials[0], "").replace(specials[1], "") == without


# -- chat: template options and echo -----------------------------------------------------------
PARTIAL = [{"role": "user", "content": "write a function"}, {"role": "assistant", "content": "def add(a, b"}]


def test_continue_final_message_continues_the_given_text(client, reference, base_url):
    extra = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    response = client.chat.completions.create(
        model=MODEL, messages=PARTIAL, max_tokens=8, seed=6, extra_body=extra
    )
    ids = reference.tokenizer.encode_chat(PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert reference.tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\ndef add(a, b")
    expected = _generate(reference, ids, max_tokens=8, seed=6, ignore_eos=True).outputs[0]
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(ids)
    assert _render(base_url, "/v1/chat/completions/render", {"messages": PARTIAL, **extra}) == ids


def test_add_generation_prompt_false_answers_in_the_last_role(client, reference):
    messages = [{"role": "user", "content": "half a question"}]
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={"add_generation_prompt": False},
    )
    ids = reference.tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert response.usage.prompt_tokens == len(ids)
    assert response.choices[0].message.role == "user"  # vLLM: the role of the message it continues
    assert (
        response.choices[0].message.content
        == _generate(reference, ids, max_tokens=5, temperature=0).outputs[0].text
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_prepends_the_continued_message(client, reference, stream):
    extra = {"add_generation_prompt": False, "continue_final_message": True, "echo": True, "ignore_eos": True}
    options = dict(model=MODEL, messages=PARTIAL, max_tokens=6, seed=8, extra_body=extra)
    ids = reference.tokenizer.encode_chat(PARTIAL, add_generation_prompt=False, continue_final_message=True)
    expected = _generate(reference, ids, max_tokens=6, seed=8, ignore_eos=True).outputs[0].text
    if stream:
        content = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**options, stream=True)
            if c.choices
        )
    else:
        content = client.chat.completions.create(**options).choices[0].message.content
    assert content == "def add(a, b" + expected


def test_chat_echo_adds_nothing_after_a_message_of_another_role(client, reference):
    messages = [{"role": "user", "content": "hi"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"echo": True}
    )
    ids = reference.tokenizer.encode_chat(messages)
    assert (
        response.choices[0].message.content
        == _generate(reference, ids, max_tokens=4, temperature=0).outputs[0].text
    )


# -- refused fields, and render validating like generation ----------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", "auto")],
)
def test_chat_functions_are_refused_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **{field: value}
        )
    assert refused.value.status_code == 400
    assert (
        refused.value.body["param"] == field and f"{field} is not supported" in refused.value.body["message"]
    )


def test_use_beam_search_is_refused_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"use_beam_search": True}
        )
    assert refused.value.body["param"] == "use_beam_search"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/completions", {"prompt": [-1]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 300}),
        ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}),
        ("/v1/completions", {"prompt": "hi", "echo": True, "suffix": "x"}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
        ),
    ],
)
def test_render_refuses_what_generation_refuses_with_the_same_error(base_url, route, body):
    generation = httpx.post(f"{base_url}{route}", json={"model": MODEL, **body}, headers=AUTH, timeout=30)
    rendering = httpx.post(
        f"{base_url}{route}/render", json={"model": MODEL, **body}, headers=AUTH, timeout=30
    )
    assert generation.status_code == rendering.status_code == 400
    assert generation.json() == rendering.json()
