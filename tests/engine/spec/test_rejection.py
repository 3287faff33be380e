"""RejectionSampler: greedy is greedy decoding, seeded point-mass verification is plain sampling
token for token, and sampled outputs follow the target distribution (chi-square, seeded)."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.sample.sampler import Sampler, make_generator
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.spec.rejection import RejectionSampler, row_offsets

VOCAB = 32
EOS = 1


def model_logits(context: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """A deterministic stand-in for a model: logits that depend on the whole context."""
    seed = int.from_bytes(hashlib.sha256(repr(context).encode()).digest()[:8], "little")
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def verify_rows(context: list[int], draft: list[int]) -> torch.Tensor:
    """What the target's forward pass gives a sequence that proposed ``draft``: row j scores the
    token after ``context + draft[:j]``."""
    return torch.stack([model_logits(context + draft[:j]) for j in range(len(draft) + 1)])


def test_row_offsets_are_cumulative_and_ragged():
    assert row_offsets([2, 0, 3]) == [0, 3, 4, 8]
    assert row_offsets([]) == [0]


def test_greedy_keeps_the_argmax_prefix_then_the_argmax():
    logits = torch.randn(5 + 1 + 3, VOCAB, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(dim=-1).tolist()
    wrong = (argmax[7] + 1) % VOCAB
    drafts = [argmax[0:4], [], [argmax[6], wrong]]  # all accepted + bonus; none; one then a miss
    out = RejectionSampler()(
        logits, drafts, [SamplingParams(temperature=0)] * 3, [None] * 3, [[]] * 3, [[2]] * 3
    )
    assert out.token_ids == [argmax[0:5], [argmax[5]], [argmax[6], argmax[7]]]
    assert out.num_accepted == [4, 0, 1]
    assert out.logprobs == [None, None, None]


SAMPLING = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=3),
    SamplingParams(
        temperature=0.9, repetition_penalty=1.6, frequency_penalty=0.4, presence_penalty=0.3, seed=4
    ),
    SamplingParams(temperature=0, repetition_penalty=2.0),
    SamplingParams(temperature=1.0, min_tokens=6, max_tokens=50, seed=5),
]


@pytest.mark.parametrize("params", SAMPLING, ids=range(len(SAMPLING)))
def test_no_proposal_is_a_plain_sample(params):
    """k = 0 for every sequence: the same tokens as the sampler, and the same generator state."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(9))
    outputs = [[3, 4, 3], [], [EOS], [5] * 4, [6, 7], [1, 2, 3, 4, 5, 6, 7]]
    prompts = [[2, 3]] * 6
    ours, theirs = (
        [make_generator(params.seed, i) for i in range(6)],
        [make_generator(params.seed, i) for i in range(6)],
    )
    plain = Sampler([EOS])(logits, [params] * 6, theirs, outputs, prompts)
    verified = RejectionSampler([EOS])(logits, [[]] * 6, [params] * 6, ours, outputs, prompts)
    assert verified.token_ids == [[t] for t in plain.token_ids]
    if params.seed is not None:
        assert [torch.rand(1, generator=g).item() for g in ours] == [
            torch.rand(1, generator=g).item() for g in theirs
        ]


def propose(rng: random.Random, truth: list[int], k: int) -> list[int]:
    """Proposals that are right often (the true continuation) and wrong sometimes."""
    return [t if rng.random() < 0.7 else rng.randrange(VOCAB) for t in truth[:k]]


@pytest.mark.parametrize("params", SAMPLING, ids=range(len(SAMPLING)))
def test_point_mass_speculation_reproduces_plain_decoding_token_for_token(params):
    """Greedy, and seeded sampling with any proposals: the same tokens as decoding one at a
    time with the same seed -- speculation changes how fast, never what."""
    prompt, length = [2, 3, 4], 40
    generator = make_generator(params.seed)
    plain = list(prompt)
    sampler = Sampler([EOS])
    while len(plain) < len(prompt) + length:
        out = sampler(model_logits(plain)[None], [params], [generator], [plain[len(prompt) :]], [prompt])
        plain += out.token_ids
    truth = plain[len(prompt) :]

    rng, generator = random.Random(7), make_generator(params.seed)
    spec, accepted_any = list(prompt), False
    verifier = RejectionSampler([EOS])
    while len(spec) < len(plain):
        done = len(spec) - len(prompt)
        draft = propose(rng, truth[done:], rng.randrange(0, 5))
        out = verifier(
            verify_rows(spec, draft), [draft], [params], [generator], [spec[len(prompt) :]], [prompt]
        )
        assert out.token_ids[0][:-1] == draft[: out.num_accepted[0]]
        accepted_any |= out.num_accepted[0] > 0
        spec += out.token_ids[0]
    assert spec[: len(plain)] == plain
    assert accepted_any


def test_a_batch_of_sequences_with_different_k_is_verified_row_by_row():
    """Verified together, ragged, each sequence gets what it gets alone."""
    params = [SAMPLING[1], SAMPLING[0], SAMPLING[4], SAMPLING[2]]
    contexts = [[2, 3], [4], [5, 6, 7], [8]]
    drafts = [[1, 2, 3], [], [int(model_logits([5, 6, 7]).argmax()), 9], [4]]
    alone = [
        RejectionSampler()(verify_rows(c, d), [d], [p], [make_generator(p.seed)], [[]], [c]).token_ids[0]
        for c, d, p in zip(contexts, drafts, params, strict=True)
    ]
    logits = torch.cat([verify_rows(c, d) for c, d in zip(contexts, drafts, strict=True)])
    together = RejectionSampler()(
        logits, drafts, params, [make_generator(p.seed) for p in params], [[]] * 4, contexts
    )
    assert together.token_ids == alone


def test_logprobs_are_the_raw_log_softmax_of_each_emitted_tokens_row():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)
    out = RejectionSampler()(logits, [argmax[:3]], [params], [None], [[argmax[0]]], [[2]])
    raw = logits.log_softmax(dim=-1)
    entries = out.logprobs[0]
    assert [e.token_id for e in entries] == out.token_ids[0]
    for row, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(raw[row, entry.token_id].item())
        assert [token for token, _ in entry.top] == raw[row].topk(3).indices.tolist()


def test_penalties_see_the_proposed_tokens_before_each_row():
    """Row 1 follows the proposed token: a repetition penalty there must count it."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 2.0
    logits[1, 6] = 1.5
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = RejectionSampler()(logits, [[5]], [params], [None], [[]], [[2]])
    assert out.token_ids == [[5, 6]]  # unpenalised, row 1 would pick 5 again


def test_min_tokens_counts_the_proposed_tokens():
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 5.0
    logits[0, 7] = logits[1, 8] = 4.0
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=10)
    out = RejectionSampler([EOS])(logits, [[7, 8]], [params], [None], [[]], [[2]])
    # rows 0 and 1 (0 and 1 tokens out) ban EOS; row 2 (2 out) does not
    assert out.token_ids == [[7, 8, EOS]]


@pytest.mark.parametrize(
    ("logits_rows", "drafts", "draft_probs", "message"),
    [
        (3, [[1, 2]], None, None),
        (2, [[1, 2]], None, "need 3"),
        (3, [[1, VOCAB]], None, "outside the vocabulary"),
        (3, [[1, 2]], (3, VOCAB), "one row per proposed token"),
    ],
)
def test_inputs_are_checked(logits_rows, drafts, draft_probs, message):
    logits = torch.zeros(logits_rows, VOCAB)
    q = None if draft_probs is None else torch.full(draft_probs, 1 / VOCAB)
    call = lambda: RejectionSampler()(logits, drafts, [SamplingParams()], [None], [[]], [[2]], q)  # noqa: E731
    if message is None:
        call()
    else:
        with pytest.raises(ValueError, match=message):
            call()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.integers(0, 2**31))
def test_seeded_verification_repeats_exactly(lengths, seed):
    rng = random.Random(seed)
    drafts = [[rng.randrange(VOCAB) for _ in range(k)] for k in lengths]
    logits = torch.randn(sum(lengths) + len(lengths), VOCAB, generator=torch.Generator().manual_seed(seed))
    q = torch.softmax(torch.randn(sum(lengths), VOCAB, generator=torch.Generator().manual_seed(seed + 1)), -1)
    params = [SamplingParams(temperature=1.0, seed=seed + i) for i in range(len(lengths))]

    def run(draft_probs):
        generators = [make_generator(p.seed) for p in params]
        outputs = [[]] * len(lengths)
        return RejectionSampler()(
            logits, drafts, params, generators, outputs, [[2]] * len(lengths), draft_probs
        )

    for draft_probs in (None, q):
        first, second = run(draft_probs), run(draft_probs)
        assert first == second
        assert all(1 <= len(t) <= k + 1 for t, k in zip(first.token_ids, lengths, strict=True))
