"""OpenAI's ``logit_bias`` and vLLM's ``allowed_token_ids``, ``bad_words``,
``include_stop_str_in_output`` and ``spaces_between_special_tokens`` through the official
``openai`` client, each one's effect on the text asserted (the built-in model writes Python, so
its greedy output is real text to steer)."""

from __future__ import annotations

import openai
import pytest

from pagedkv import SamplingParams
from tests.server.helpers import MODEL

PROMPT = "def parse_header(line):\n"


pytestmark = pytest.mark.usefixtures("leaves_server_idle")


def _complete(client, max_tokens: int = 12, **extra) -> str:
    """The greedy completion of ``PROMPT``; ``extra`` goes in the body (``logit_bias`` is OpenAI's)."""
    bias = extra.pop("logit_bias", None)
    options = {"logit_bias": bias} if bias is not None else {}
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=extra, **options
    )
    return response.choices[0].text


def _greedy(reference, max_tokens: int = 12, **params):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    return reference.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def test_a_bias_of_100_makes_greedy_output_that_token(client, reference):
    token = reference.tokenizer.encode("xyz", add_special_tokens=False)[0]
    assert token not in _greedy(reference).token_ids
    text = _complete(client, max_tokens=5, logit_bias={str(token): 100})
    assert text == reference.tokenizer.decode([token] * 5)


def test_a_bias_of_minus_100_on_the_greedy_token_changes_the_output(client, reference):
    free = _greedy(reference)
    first = free.token_ids[0]
    text = _complete(client, logit_bias={str(first): -100})
    steered = _greedy(reference, logit_bias={first: -100})
    assert text == steered.text != free.text
    assert first not in steered.token_ids


def test_chat_takes_logit_bias_too(client, reference):
    token = reference.tokenizer.encode("xyz", add_special_tokens=False)[0]
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(token): 100},
    )
    assert response.choices[0].message.content == reference.tokenizer.decode([token] * 3)


def test_allowed_token_ids_restrict_every_output_token(client, reference):
    allowed = {reference.tokenizer.encode(c, add_special_tokens=False)[0]: c for c in "ab("}
    text = _complete(client, max_tokens=10, allowed_token_ids=list(allowed), ignore_eos=True)
    assert len(text) == 10 and set(text) <= set(allowed.values())
    assert text == _greedy(reference, max_tokens=10, allowed_token_ids=list(allowed), ignore_eos=True).text


def test_bad_words_never_appear_in_the_text(client, reference):
    free = _greedy(reference, max_tokens=24).text
    assert "file" in free  # the unconstrained greedy answer says it
    text = _complete(client, max_tokens=24, bad_words=["file"])
    assert "file" not in text and text != free
    assert text == _greedy(reference, max_tokens=24, bad_words=["file"]).text


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, reference, stream):
    free = _greedy(reference, max_tokens=24).text
    stop = "Return"
    assert stop in free
    options = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    extra = {"include_stop_str_in_output": True}
    if stream:
        chunks = list(client.completions.create(**options, extra_body=extra, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        last = [c.choices[0] for c in chunks if c.choices][-1]
    else:
        last = client.completions.create(**options, extra_body=extra).choices[0]
        text = last.text
    assert text == free[: free.index(stop) + len(stop)] and last.finish_reason == "stop"
    assert last.model_extra["stop_reason"] == stop  # vLLM's field: which stop ended it
    without = client.completions.create(**options).choices[0].text
    assert without == free[: free.index(stop)]


def test_spaces_between_special_tokens_reaches_the_detokenizer(client, reference):
    """Byte-level BPE writes no space between special tokens: both settings give its decode."""
    shown = {"skip_special_tokens": False, "ignore_eos": True}
    expected = _greedy(reference, max_tokens=12, ignore_eos=True, skip_special_tokens=False).text
    assert _complete(client, **shown, spaces_between_special_tokens=False) == expected
    assert _complete(client, **shown, spaces_between_special_tokens=True) == expected
    with pytest.raises(openai.BadRequestError) as refused:
        _complete(client, spaces_between_special_tokens="no")
    assert refused.value.body["param"] == "spaces_between_special_tokens"
