"""``logit_bias``, ``allowed_token_ids`` and ``bad_words`` in the sampler and the verifier: each
changes what its own row samples, and nothing else (other rows keep their exact tokens, the
reported logprobs stay the model's own)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.sample.sampler import Sampler, make_generator
from pagedkv.engine.sample.token_constraints import apply_token_constraints, banned_bad_word_tokens
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.spec.rejection import RejectionSampler

VOCAB = 64


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits, params, outputs=None, generators=None):
    rows = logits.shape[0]
    outputs = outputs or [[] for _ in range(rows)]
    return Sampler()(logits, params, generators or [None] * rows, outputs, [[] for _ in range(rows)])


def with_bad_words(words: list[list[int]], **fields) -> SamplingParams:
    """Params whose bad words are already token ids (what ``update_from_tokenizer`` sets)."""
    params = SamplingParams(**fields)
    params.bad_words_token_ids = words
    return params


GREEDY = SamplingParams(temperature=0)


def test_rows_without_constraints_are_returned_untouched() -> None:
    logits = random_logits(4, seed=0)
    assert apply_token_constraints(logits, [GREEDY] * 4, [[]] * 4) is logits


def test_a_large_bias_makes_its_token_the_greedy_choice_and_a_large_negative_one_removes_it() -> None:
    logits = random_logits(3, seed=1)
    argmax = logits.argmax(dim=-1).tolist()
    target = (argmax[0] + 1) % VOCAB
    params = [
        SamplingParams(temperature=0, logit_bias={target: 100}),
        SamplingParams(temperature=0, logit_bias={argmax[1]: -100}),
        GREEDY,
    ]
    tokens = sample(logits, params).token_ids
    assert tokens[0] == target
    assert tokens[1] != argmax[1] and tokens[1] == logits[1].topk(2).indices[1].item()
    assert tokens[2] == argmax[2]


def test_bias_is_added_to_the_logit() -> None:
    logits = random_logits(1, seed=2)
    out = apply_token_constraints(logits, [SamplingParams(logit_bias={3: 1.5, 7: -2.0})], [[]])
    expected = logits.clone()
    expected[0, 3] += 1.5
    expected[0, 7] -= 2.0
    assert torch.equal(out, expected)
    assert not torch.equal(logits, expected)  # the caller's logits stay as they were


def test_allowed_token_ids_bound_every_draw() -> None:
    allowed = [5, 17, 40]
    logits = random_logits(32, seed=3)
    params = [SamplingParams(temperature=1.5, allowed_token_ids=allowed)] * 32
    tokens = sample(logits, params, generators=[make_generator(i) for i in range(32)]).token_ids
    assert set(tokens) <= set(allowed)
    assert len(set(tokens)) > 1  # a draw among them, not one forced token


def test_greedy_with_allowed_token_ids_takes_the_best_allowed_token() -> None:
    logits = random_logits(1, seed=4)
    allowed = [2, 9, 33]
    token = sample(logits, [SamplingParams(temperature=0, allowed_token_ids=allowed)]).token_ids[0]
    assert token == max(allowed, key=lambda t: logits[0, t].item())


def test_logprobs_are_the_models_own_whatever_the_constraints() -> None:
    """vLLM v1's raw logprobs: the bias changes the token chosen, not the numbers reported."""
    logits = random_logits(1, seed=5)
    target = (logits.argmax().item() + 3) % VOCAB
    out = sample(logits, [SamplingParams(temperature=0, logprobs=2, logit_bias={target: 100})])
    raw = logits.log_softmax(dim=-1)[0]
    assert out.token_ids == [target]
    assert out.logprobs[0].logprob == pytest.approx(raw[target].item())
    assert [t for t, _ in out.logprobs[0].top] == raw.topk(2).indices.tolist()


@pytest.mark.parametrize(
    ("output", "banned"),
    [([], [9]), ([1, 2], [9, 4]), ([2, 1], [9]), ([7, 1, 2], [9, 4]), ([1], [9])],
)
def test_a_bad_words_last_token_is_banned_after_its_other_tokens(output, banned) -> None:
    assert banned_bad_word_tokens([[9], [1, 2, 4]], output) == banned


def test_bad_words_are_never_completed_by_greedy_decoding() -> None:
    logits = random_logits(1, seed=6)
    best = logits.argmax().item()
    params = with_bad_words([[11, best]], temperature=0)
    assert sample(logits, [params], outputs=[[3, 11]]).token_ids[0] != best
    assert sample(logits, [params], outputs=[[11, 3]]).token_ids[0] == best  # prefix not at the end


def test_other_rows_keep_their_exact_tokens_and_draws() -> None:
    logits = random_logits(6, seed=7)
    plain = [SamplingParams(temperature=0.8, seed=i) for i in range(6)]
    alone = sample(logits, plain, generators=[make_generator(i) for i in range(6)]).token_ids
    mixed = list(plain)
    mixed[1] = SamplingParams(temperature=0.8, seed=1, logit_bias={0: 100})
    mixed[4] = with_bad_words([[alone[4]]], temperature=0.8, seed=4, allowed_token_ids=[alone[4], 1])
    together = sample(logits, mixed, generators=[make_generator(i) for i in range(6)]).token_ids
    assert [together[i] for i in (0, 2, 3, 5)] == [alone[i] for i in (0, 2, 3, 5)]
    assert together[1] == 0 and together[4] == 1


def test_speculative_verification_applies_the_same_constraints() -> None:
    """A greedy row keeps a proposed token only if the constrained argmax is that token."""
    logits = random_logits(3, seed=8)  # two proposed tokens, then the bonus row
    argmax = logits.argmax(dim=-1).tolist()
    allowed = [argmax[0], 21, 22]
    params = [
        with_bad_words([[argmax[0], argmax[1]]], temperature=0, allowed_token_ids=[*allowed, argmax[1]])
    ]
    verified = RejectionSampler()(logits, [[argmax[0], argmax[1]]], params, [None], [[]], [[]])
    second = max([*allowed], key=lambda t: logits[1, t].item())
    assert verified.token_ids == [[argmax[0], second]]
