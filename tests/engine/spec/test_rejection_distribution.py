"""Rejection sampling keeps the target distribution: chi-square tests over an 8-token vocabulary.

A two-token "model" whose second distribution depends on the first token, and a draft whose
proposals do too. Over 20,000 seeded trials the first emitted token must follow the target's
first distribution, and the second (when the first proposed token was accepted) the target's
distribution given the first. Every trial draws from its own seeded generator, so the test is
deterministic; at a significance level of 1e-4 it fails by orders of magnitude when the
residual is replaced by the target distribution (``max(0, p - q)`` is what makes it exact).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.sample.sampler import make_generator
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.spec.rejection import RejectionSampler

VOCAB, TRIALS, BATCH = 8, 20000, 5000
SIGNIFICANCE = 1e-4


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic and its p-value (chi-square survival function with ``bins - 1``
    degrees of freedom per row: the regularized upper incomplete gamma function)."""
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    statistic = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - expected.shape[0] if expected.dim() == 2 else int(keep.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2))
    return statistic, float(p_value)


def test_the_p_value_rejects_what_it_should():
    expected = torch.full((4,), 250.0, dtype=torch.float64)
    assert chi_square_p_value(torch.tensor([250.0, 250, 250, 250]), expected)[1] == pytest.approx(1.0)
    assert chi_square_p_value(torch.tensor([300.0, 200, 250, 250]), expected)[1] < 0.01  # statistic 20, dof 3


class Scenario:
    """Target logits: ``first`` for the first token, ``second[t]`` after token ``t``, ``third[t]``
    after a second token ``t``; draft distributions ``q_first`` and ``q_second[t]``."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.first = torch.randn(VOCAB, generator=gen)
        self.second = torch.randn(VOCAB, VOCAB, generator=gen)
        self.third = torch.randn(VOCAB, VOCAB, generator=gen)
        self.q_first = torch.softmax(torch.randn(VOCAB, generator=gen), -1)
        self.q_second = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen), -1)

    def run(self, params: SamplingParams, with_draft_probs: bool) -> list[list[int]]:
        """Every trial's emitted tokens."""
        drafts_gen = torch.Generator().manual_seed(12345)
        sampler, emitted = RejectionSampler(), []
        for start in range(0, TRIALS, BATCH):
            x1 = torch.multinomial(self.q_first.expand(BATCH, VOCAB), 1, generator=drafts_gen).squeeze(1)
            x2 = torch.multinomial(self.q_second[x1], 1, generator=drafts_gen).squeeze(1)
            logits = torch.stack([self.first.expand(BATCH, VOCAB), self.second[x1], self.third[x2]], 1)
            q = torch.stack([self.q_first.expand(BATCH, VOCAB), self.q_second[x1]], 1)
            out = sampler(
                logits.reshape(-1, VOCAB),
                torch.stack([x1, x2], 1).tolist(),
                [params] * BATCH,
                [make_generator(params.seed, start + i) for i in range(BATCH)],
                [[] for _ in range(BATCH)],
                [[0]] * BATCH,
                q.reshape(-1, VOCAB) if with_draft_probs else None,
            )
            emitted += out.token_ids
        return emitted


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from, computed here independently: softmax at the
    temperature, restricted to the ``top_k`` most likely tokens."""
    probs = torch.softmax(logits.double() / params.temperature, -1)
    if 0 < params.top_k < VOCAB:
        kept = probs.topk(params.top_k, dim=-1).indices
        probs = torch.zeros_like(probs).scatter(-1, kept, probs.gather(-1, kept))
    return probs / probs.sum(-1, keepdim=True)


CASES = {
    "draft-probs": (SamplingParams(temperature=1.0, seed=0), True),
    "point-mass": (SamplingParams(temperature=1.0, seed=0), False),
    "draft-probs-top-k": (SamplingParams(temperature=0.7, top_k=5, seed=0), True),
    "point-mass-top-k": (SamplingParams(temperature=0.7, top_k=5, seed=0), False),
}


@pytest.mark.parametrize("case", CASES)
def test_emitted_tokens_follow_the_target_distribution(case):
    params, with_draft_probs = CASES[case]
    scenario = Scenario(seed=3)
    emitted = scenario.run(params, with_draft_probs)

    first = torch.tensor([tokens[0] for tokens in emitted])
    expected_first = target(scenario.first, params) * TRIALS
    statistic, p_value = chi_square_p_value(torch.bincount(first, minlength=VOCAB).double(), expected_first)
    assert p_value > SIGNIFICANCE, f"first token: chi-square {statistic:.1f}, p = {p_value:.2e}"

    pairs = torch.tensor([tokens[:2] for tokens in emitted if len(tokens) >= 2])
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    counts.index_put_(
        (pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs), dtype=torch.float64), accumulate=True
    )
    groups = counts.sum(-1) >= 200  # first tokens seen often enough to test what follows them
    assert int(groups.sum()) >= 3
    expected_second = target(scenario.second, params) * counts.sum(-1, keepdim=True)
    statistic, p_value = chi_square_p_value(counts[groups], expected_second[groups])
    assert p_value > SIGNIFICANCE, (
        f"second token given the first: chi-square {statistic:.1f}, p = {p_value:.2e}"
    )
