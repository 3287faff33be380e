"""Offline users get the server's checks: vocabulary, text, context and request limits.

Each refusal is an ``InvalidRequestError`` naming the field (``param``) before the request takes
any engine state; the next request is served as usual.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.engine import InvalidRequestError, RequestLimits
from pagedkv.engine.sampling_params import unpaired_surrogate_at
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint

LIMITS = RequestLimits(
    max_n=4,
    max_beam_width=3,
    max_request_tokens=200,
    max_stop_strings=3,
    max_stop_chars=10,
    max_stop_token_ids=2,
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = make_checkpoint(tmp_path_factory.mktemp("validation"), "llama")
    return LLM(str(path), num_kv_blocks=64, block_size=4, max_model_len=128, limits=LIMITS)


def _refused(llm: LLM, run) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        run()
    assert not llm.engine.has_unfinished_requests()
    assert llm.kv_stats()["blocks_used"] == 0
    return info.value


@pytest.mark.parametrize(
    "prompt, params, param, says",
    [
        (
            [5, 6],
            SamplingParams(stop_token_ids=[TEST_VOCAB_SIZE]),
            "stop_token_ids",
            f"[0, {TEST_VOCAB_SIZE})",
        ),
        ([5, TEST_VOCAB_SIZE + 1], SamplingParams(), "prompt", "vocabulary"),
        ([5, 6], SamplingParams(logit_bias={3: 1, TEST_VOCAB_SIZE: 5}), "logit_bias", f"[{TEST_VOCAB_SIZE}]"),
        (
            [5, 6],
            SamplingParams(allowed_token_ids=[3, TEST_VOCAB_SIZE + 2]),
            "allowed_token_ids",
            f"holds [{TEST_VOCAB_SIZE + 2}], which are not token ids of the vocabulary",
        ),
        ([5, -1], SamplingParams(), "prompt", "vocabulary"),
        ([5, "6"], SamplingParams(), "prompt", "vocabulary"),
        ("a\ud800b", SamplingParams(), "prompt", "unpaired UTF-16 surrogate"),
        ([5] * 120, SamplingParams(max_tokens=20), "max_tokens", "maximum context length is 128"),
        ([5] * 130, SamplingParams(max_tokens=1), "prompt", "maximum context length is 128"),
        ([5, 6], SamplingParams(n=5), "n", "max_n = 4"),
        ([5] * 40, SamplingParams(n=4, max_tokens=20), "max_tokens", "max_request_tokens = 200"),
        (
            [5, 6],
            SamplingParams(stop=["a", "b", "c", "d"]),
            "stop",
            "stop holds 4 strings, over the limit max_stop_strings = 3",
        ),
        (
            [5, 6],
            SamplingParams(stop=["abcdef", "ghijk"]),
            "stop",
            "11 characters in all, over the limit max_stop_chars = 10",
        ),
        ([5, 6], SamplingParams(stop_token_ids=[7, 8, 9]), "stop_token_ids", "max_stop_token_ids = 2"),
        # The count is checked before the ids themselves.
        (
            [5, 6],
            SamplingParams(stop_token_ids=[TEST_VOCAB_SIZE] * 3),
            "stop_token_ids",
            "max_stop_token_ids = 2",
        ),
    ],
)
def test_a_bad_request_is_refused_naming_its_field(llm, prompt, params, param, says):
    error = _refused(llm, lambda: llm.generate([prompt], params, use_tqdm=False))
    assert error.param == param
    assert says in str(error)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_stop_lists_at_their_limits_are_served(llm):
    """Three strings of ten characters in all and two ids: each limit reached, none passed."""
    params = SamplingParams(max_tokens=6, stop=["abc", "defg", "hij"], stop_token_ids=[7, 8])
    out = llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason in ("stop", "length") and out.token_ids
    assert llm.kv_stats()["blocks_used"] == 0


def test_beam_width_and_beam_tokens_have_limits(llm):
    wide = _refused(llm, lambda: llm.beam_search([[5, 6]], BeamSearchParams(beam_width=4, max_tokens=4)))
    assert (wide.param, "max_beam_width = 3" in str(wide)) == ("beam_width", True)
    long = _refused(llm, lambda: llm.beam_search([[5] * 60], BeamSearchParams(beam_width=3, max_tokens=20)))
    assert "3 x (60 prompt + 20 max_tokens)" in str(long) and long.param == "max_tokens"


def test_sampling_params_refuse_stop_strings_that_are_not_text():
    with pytest.raises(ValueError, match="SamplingParams.stop must be valid Unicode text"):
        SamplingParams(stop=["fine", "half \udc00 pair"])
    assert SamplingParams(stop=["\U0001f600"]).stop == ["\U0001f600"]  # a real pair is one character


def test_surrogates_are_found_only_when_unpaired():
    assert unpaired_surrogate_at("ok \U0001f600") is None
    assert unpaired_surrogate_at("ab\ud83d") == 2
    assert unpaired_surrogate_at("\udc00") == 0


@pytest.mark.parametrize(
    "field",
    [
        "max_n",
        "max_beam_width",
        "max_request_tokens",
        "max_stop_strings",
        "max_stop_chars",
        "max_stop_token_ids",
    ],
)
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_limits_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"RequestLimits.{field}"):
        RequestLimits(**{field: value})


def test_the_token_budget_defaults_to_what_the_engine_can_hold_at_once():
    unset = RequestLimits()
    # the pool, or max_num_seqs full contexts where that is less
    assert unset.resolved(pool_tokens=1024, max_num_seqs=64, max_model_len=2048).max_request_tokens == 1024
    assert unset.resolved(pool_tokens=1 << 20, max_num_seqs=4, max_model_len=512).max_request_tokens == 2048
    chosen = RequestLimits(max_request_tokens=1 << 18)  # a deployer's value stays
    assert chosen.resolved(pool_tokens=1024, max_num_seqs=64, max_model_len=2048) == chosen
