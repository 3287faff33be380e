"""SpecPolicy: speculation backs off when proposals fail, probes again, and stays on when they
succeed; a large batch or a full token budget turns it off; low acceptance costs little."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.spec import AcceptanceEstimate, SpecPolicy, StepCostModel

K = 4


def run_steps(policy: SpecPolicy, batch: int, steps: int, accept: bool) -> list[list[int]]:
    """Drive ``policy`` with proposals that are always accepted (or always rejected); the
    lengths it verified at each step."""
    seq_ids = list(range(batch))
    verified = []
    for _ in range(steps):
        lengths = policy.draft_lengths(seq_ids, [100] * batch)
        lengths = policy.verify_lengths(seq_ids, lengths)
        for seq_id, k in zip(seq_ids, lengths, strict=True):
            policy.observe(seq_id, k, k if accept else 0)
        verified.append(lengths)
    return verified


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_always_rejected_proposals_back_off_then_probe(batch):
    policy = SpecPolicy(K, max_num_batched_tokens=2048, probe_interval=16)
    verified = run_steps(policy, batch, steps=200, accept=False)
    assert verified[0] != [0] * batch  # it tries first
    backed_off = next(step for step, lengths in enumerate(verified) if not any(lengths))
    assert backed_off <= 3
    probes = [step for step in range(backed_off, 200) if any(verified[step])]
    assert probes == [step for step in range(backed_off, 200) if (step + 1) % 16 == 0]
    assert all(verified[step] == [1] * batch for step in probes)  # a probe proposes one token
    assert policy.draft_lengths(range(batch), [100] * batch) == [0] * batch
    assert policy.estimate(0).rate < 0.05


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_always_accepted_proposals_keep_the_maximum(batch):
    policy = SpecPolicy(K, max_num_batched_tokens=2048)
    verified = run_steps(policy, batch, steps=100, accept=True)
    assert all(lengths == [K] * batch for lengths in verified[1:])
    assert all(k >= K - 1 for k in verified[0])  # the optimistic prior: nearly all from the start


def test_acceptance_that_returns_brings_speculation_back():
    policy = SpecPolicy(K, max_num_batched_tokens=2048, probe_interval=8)
    run_steps(policy, 1, steps=64, accept=False)
    assert policy.draft_lengths([0], [100]) == [0]
    resumed = run_steps(policy, 1, steps=64, accept=True)
    assert resumed[-1] == [K]
    assert sum(map(sum, resumed)) > 32 * K


@pytest.mark.parametrize("batch", [32, 64])
def test_low_acceptance_costs_under_five_percent_at_large_batches(batch):
    """With every proposal rejected, the steps' modelled cost stays within 5% of plain decoding."""
    cost = StepCostModel(saturation_tokens=64, verify_overhead=1.0)
    policy = SpecPolicy(K, max_num_batched_tokens=4096, cost=cost)
    verified = run_steps(policy, batch, steps=1000, accept=False)
    spent = sum(cost.step_cost(batch + sum(lengths), verifies=any(lengths)) for lengths in verified)
    plain = 1000 * cost.step_cost(batch, verifies=False)
    assert spent / plain - 1 < 0.05


def test_a_large_batch_does_not_speculate_on_moderate_acceptance_where_a_small_one_does():
    cost = StepCostModel(saturation_tokens=16, verify_overhead=0.5)
    policy = SpecPolicy(K, max_num_batched_tokens=4096, cost=cost, prior=(1.0, 1.0))
    policy.draft_lengths([0], [100])  # step 1: not a probe step
    assert policy.verify_lengths(range(2), [K, K]) == [K, K]
    assert policy.verify_lengths(range(128), [K] * 128) == [0] * 128


def test_disable_by_batch_size_turns_speculation_off():
    policy = SpecPolicy(K, max_num_batched_tokens=2048, disable_by_batch_size=4)
    assert policy.draft_lengths(range(4), [10] * 4) == [K] * 4
    assert policy.draft_lengths(range(5), [10] * 5) == [0] * 5


def test_room_caps_each_draft():
    policy = SpecPolicy(K, max_num_batched_tokens=2048)
    assert policy.draft_lengths(range(3), [0, 2, 10]) == [0, 2, K]


@settings(max_examples=100, deadline=None)
@given(
    proposals=st.lists(st.integers(0, K), min_size=1, max_size=40),
    budget=st.integers(1, 200),
    other=st.integers(0, 50),
)
def test_verified_lengths_fit_the_token_budget(proposals, budget, other):
    policy = SpecPolicy(K, max_num_batched_tokens=budget, probe_interval=1)  # every step probes
    policy.draft_lengths(range(len(proposals)), [K] * len(proposals))
    lengths = policy.verify_lengths(range(len(proposals)), proposals, other_tokens=other)
    assert all(0 <= k <= p for k, p in zip(lengths, proposals, strict=True))
    assert len(proposals) + sum(lengths) + other <= budget or not any(lengths)


def test_estimates_follow_recent_drafts_and_are_forgotten_on_release():
    estimate = AcceptanceEstimate(3.0, 1.0)
    assert estimate.rate == 0.75
    assert estimate.expected_accepted(2) == pytest.approx(0.75 + 0.75**2)
    estimate.observe(4, 4, decay=0.5)  # all accepted: no rejection counted
    assert (estimate.accepted, estimate.rejected) == (5.5, 0.5)
    policy = SpecPolicy(K, max_num_batched_tokens=64)
    policy.observe(7, 4, 0)
    assert policy.estimate(7).rate < 0.75
    policy.release(7)
    policy.release(7)
    assert policy.estimate(7).rate == 0.75


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"probe_interval": 0}, "probe_interval"),
        ({"decay": 0.0}, "decay"),
        ({"prior": (0.0, 1.0)}, "prior"),
    ],
)
def test_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecPolicy(**{"num_speculative_tokens": K, "max_num_batched_tokens": 64, **kwargs})
    with pytest.raises(ValueError, match="saturation_tokens"):
        StepCostModel(saturation_tokens=0)
