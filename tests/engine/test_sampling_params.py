"""SamplingParams: every field is checked on construction, and the error names field and value."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pagedkv.engine.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, -1, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert p.prompt_logprobs is None
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not p.ignore_eos and p.min_tokens == 0 and not p.greedy and p.skip_special_tokens


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, "SamplingParams.n must be >= 1, got 0"),
        ("n", True, "SamplingParams.n must be an integer, got True"),
        ("n", 2.0, "SamplingParams.n must be an integer, got 2.0"),
        ("max_tokens", 0, "SamplingParams.max_tokens must be >= 1, got 0"),
        ("max_tokens", "16", "SamplingParams.max_tokens must be an integer, got '16'"),
        ("temperature", -1, "SamplingParams.temperature must be >= 0, got -1"),
        ("temperature", float("nan"), "SamplingParams.temperature must be finite, got nan"),
        ("temperature", None, "SamplingParams.temperature must be a number, got None"),
        ("temperature", False, "SamplingParams.temperature must be a number, got False"),
        ("top_p", 0.0, "SamplingParams.top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "SamplingParams.top_p must be in (0, 1], got 1.5"),
        ("top_k", -2, "SamplingParams.top_k must be >= -1, got -2"),
        ("top_k", 1.5, "SamplingParams.top_k must be an integer, got 1.5"),
        ("min_p", -0.1, "SamplingParams.min_p must be in [0, 1], got -0.1"),
        ("min_p", 1.1, "SamplingParams.min_p must be in [0, 1], got 1.1"),
        ("seed", "7", "SamplingParams.seed must be an integer, got '7'"),
        ("seed", 2**64, f"SamplingParams.seed must be <= {2**64 - 1}, got {2**64}"),
        ("seed", True, "SamplingParams.seed must be an integer, got True"),
        ("stop", 5, "SamplingParams.stop must be a string or a list of strings, got 5"),
        ("stop", ["a", 3], "SamplingParams.stop must be a string or a list of strings, got ['a', 3]"),
        ("stop", [""], "SamplingParams.stop must be made of non-empty strings, got ['']"),
        ("stop_token_ids", 2, "SamplingParams.stop_token_ids must be a list of integers, got 2"),
        ("stop_token_ids", [1, -1], "SamplingParams.stop_token_ids must be >= 0, got -1"),
        ("stop_token_ids", [1.0], "SamplingParams.stop_token_ids must be an integer, got 1.0"),
        ("ignore_eos", 1, "SamplingParams.ignore_eos must be a bool, got 1"),
        ("skip_special_tokens", "no", "SamplingParams.skip_special_tokens must be a bool, got 'no'"),
        ("logprobs", -1, "SamplingParams.logprobs must be >= 0, got -1"),
        ("logprobs", MAX_LOGPROBS + 1, f"SamplingParams.logprobs must be <= {MAX_LOGPROBS}, got 21"),
        ("prompt_logprobs", -1, "SamplingParams.prompt_logprobs must be >= 0, got -1"),
        ("prompt_logprobs", 21, f"SamplingParams.prompt_logprobs must be <= {MAX_LOGPROBS}, got 21"),
        ("prompt_logprobs", True, "SamplingParams.prompt_logprobs must be an integer, got True"),
        ("prompt_logprobs", "2", "SamplingParams.prompt_logprobs must be an integer, got '2'"),
        ("presence_penalty", 2.5, "SamplingParams.presence_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", -3, "SamplingParams.frequency_penalty must be in [-2, 2], got -3"),
        ("repetition_penalty", 0, "SamplingParams.repetition_penalty must be > 0, got 0"),
        ("repetition_penalty", float("inf"), "SamplingParams.repetition_penalty must be finite, got inf"),
        ("min_tokens", -1, "SamplingParams.min_tokens must be >= 0, got -1"),
        ("min_tokens", 17, "SamplingParams.min_tokens must be <= max_tokens (16), got 17"),
        ("logit_bias", [1], "SamplingParams.logit_bias must be a dict of token id -> bias, got [1]"),
        ("logit_bias", {"5": 1}, "SamplingParams.logit_bias must be an integer, got '5'"),
        ("logit_bias", {-1: 1}, "SamplingParams.logit_bias must be >= 0, got -1"),
        ("logit_bias", {5: 100.5}, "SamplingParams.logit_bias[5] must be in [-100.0, 100.0], got 100.5"),
        ("logit_bias", {5: float("nan")}, "SamplingParams.logit_bias[5] must be finite, got nan"),
        (
            "allowed_token_ids",
            [],
            "SamplingParams.allowed_token_ids must be a non-empty list of token ids, got []",
        ),
        ("allowed_token_ids", [1, -2], "SamplingParams.allowed_token_ids must be >= 0, got -2"),
        ("allowed_token_ids", 3, "SamplingParams.allowed_token_ids must be a list of integers, got 3"),
        ("bad_words", "word", "SamplingParams.bad_words must be a list of strings, got 'word'"),
        (
            "bad_words",
            ["a", " "],
            "SamplingParams.bad_words must be made of words that are not blank, got ['a', ' ']",
        ),
        ("include_stop_str_in_output", 1, "SamplingParams.include_stop_str_in_output must be a bool, got 1"),
        (
            "spaces_between_special_tokens",
            None,
            "SamplingParams.spaces_between_special_tokens must be a bool, got None",
        ),
    ],
)
def test_invalid_values_are_rejected_naming_field_and_value(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(**{field: value})


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, np.int64(9)), top_k=0, temperature=0, seed=np.int32(3))
    assert p.stop == ["###"] and p.stop_token_ids == [7, 9] and p.top_k == -1
    assert type(p.temperature) is float and type(p.seed) is int and type(p.stop_token_ids[1]) is int
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_greedy_is_temperature_zero() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        top_p=1.0,
        min_p=1.0,
        top_k=1,
        seed=-(2**63),
        logprobs=MAX_LOGPROBS,
        prompt_logprobs=0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-3,
        min_tokens=16,
    )
    assert p.min_tokens == p.max_tokens and p.logprobs == MAX_LOGPROBS and p.seed == -(2**63)
    assert p.prompt_logprobs == 0 and SamplingParams(prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == 20


def test_token_fields_default_to_off_and_normalise() -> None:
    p = SamplingParams()
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None
    assert not p.include_stop_str_in_output and p.spaces_between_special_tokens and not p.constrains_tokens
    q = SamplingParams(logit_bias={np.int64(3): -100, 4: 100}, allowed_token_ids=(np.int32(7),), bad_words=[])
    assert q.logit_bias == {3: -100.0, 4: 100.0} and type(next(iter(q.logit_bias))) is int
    assert q.allowed_token_ids == [7] and q.bad_words is None and q.constrains_tokens
    assert SamplingParams(logit_bias={}).logit_bias is None


class _Words:
    """A tokenizer whose words carry their leading space, as byte-level BPE's do."""

    VOCAB = {"bad": 1, " bad": 2, "wo": 3, "rd": 4, " wo": 5, "x": 6, " x": 6}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        pieces = {"bad": ["bad"], " bad": [" bad"], "word": ["wo", "rd"], " word": [" wo", "rd"]}
        return [self.VOCAB[p] for p in pieces.get(text, [text])]


def test_bad_words_are_tokenized_with_and_without_a_leading_space() -> None:
    """vLLM's rule: the spaced form is kept when it is other tokens of the same length."""
    p = SamplingParams(bad_words=["bad", "  word", "x"])
    p.update_from_tokenizer(_Words())
    assert p.bad_words_token_ids == [[1], [2], [3, 4], [5, 4], [6]]
