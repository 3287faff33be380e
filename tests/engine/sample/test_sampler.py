"""Sampler: greedy, filters, penalties, seeded reproducibility, the drawn distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)
from pagedkv.engine.sampling_params import SamplingParams

VOCAB = 64


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    sampler: Sampler | None = None,
):
    rows = logits.shape[0]
    return (sampler or Sampler())(
        logits,
        params,
        generators or [None] * rows,
        outputs or [[] for _ in range(rows)],
        prompts or [[] for _ in range(rows)],
    )


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    logits = random_logits(8, seed=0)
    logits[3, 10] = logits[3, 40] = logits[3].max() + 1.0
    out = sample(logits, [SamplingParams(temperature=0)] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 10
    assert out.logprobs == [None] * 8


def test_greedy_picks_what_torch_argmax_picks_with_nan_inf_and_ties() -> None:
    """The CPU greedy path goes through NumPy's argmax: same index as torch's on awkward rows."""
    logits = random_logits(6, seed=5)
    logits[0, 7] = logits[0, 3] = math.nan  # the first NaN wins
    logits[1] = -math.inf  # nothing is possible: index 0
    logits[2, 9] = logits[2, 50] = math.inf
    logits[3, 1:] = logits[3, 0]  # all equal
    greedy = SamplingParams(temperature=0)
    expected = logits.argmax(dim=-1).tolist()
    assert sample(logits, [greedy] * 6).token_ids == expected
    assert sample(logits.t().contiguous().t(), [greedy] * 6).token_ids == expected  # column-major
    mixed = [greedy, SamplingParams(temperature=1.0), greedy, greedy, SamplingParams(top_k=1), greedy]
    tokens = sample(logits, mixed, [make_generator(i) for i in range(6)]).token_ids
    assert [t for t, p in zip(tokens, mixed, strict=True) if p.greedy] == [expected[i] for i in (0, 2, 3, 5)]


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_filters_at_their_tightest_are_greedy(filters: dict) -> None:
    logits = random_logits(16, seed=1)
    params = [SamplingParams(temperature=1.3, **filters)] * 16
    gens = [make_generator(i) for i in range(16)]
    assert sample(logits, params, gens).token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_keeps_tokens_above_the_fraction_of_the_top_probability() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = apply_min_p(probs.log(), torch.tensor([0.4])).isfinite()  # threshold 0.4 * 0.5 = 0.2
    assert kept.tolist() == [[True, True, False, False]]
    draws = sample(probs.log().repeat(2000, 1), [SamplingParams(min_p=0.4)] * 2000).token_ids
    assert set(draws) == {0, 1}


def test_top_k_and_top_p_masks() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5], [0.25, 0.25, 0.25, 0.25]]).log()
    top_k = torch.tensor([2, 4, 4])
    top_p = torch.tensor([1.0, 0.7, 1.0])
    kept = apply_top_k_top_p(logits, top_k, top_p).isfinite().tolist()
    assert kept[0] == [True, True, False, False]  # top_k = 2
    assert kept[1] == [False, False, True, True]  # 0.5 + 0.3 reaches 0.7
    assert kept[2] == [True] * 4  # no filter: ties and rounding keep everything
    assert apply_top_k_top_p(logits[2:], torch.tensor([2]), torch.tensor([1.0])).isfinite().tolist() == [
        [True, True, False, False]  # exactly k on ties, lowest ids first
    ]


def test_penalties_match_a_hand_computed_example() -> None:
    raw = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.2]] * 2)
    penalised = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = apply_penalties(raw, [penalised, SamplingParams()], [[3, 3, 4], [3, 3, 4]], [[0, 1], [0, 1]])
    assert torch.equal(raw[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.2]))  # a new tensor
    # token 0 prompt, positive: 2 / 2; token 1 prompt, negative: -1 * 2; token 2 and 5 unseen;
    # token 3 output twice: 3 / 2 - 0.5 * 2 - 0.25; token 4 output once: -2 * 2 - 0.5 - 0.25.
    expected = torch.tensor([1.0, -2.0, 0.5, 0.25, -4.75, 1.2])
    assert torch.allclose(logits[0], expected), logits[0]
    assert torch.equal(logits[1], raw[1])
    greedy = SamplingParams(
        temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    out = sample(raw, [greedy, SamplingParams(temperature=0)], outputs=[[3, 3, 4]] * 2, prompts=[[0, 1]] * 2)
    assert out.token_ids == [5, 3]  # the penalised row turns away from 3; its neighbour does not
    assert torch.equal(raw[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.2]))  # caller's tensor untouched


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2], logits[0, 5], logits[0, 6] = 3.0, 2.0, 1.0
    sampler = Sampler(eos_token_ids=[2])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sample(logits, [p], outputs=[[7]], sampler=sampler).token_ids == [6]
    assert sample(logits, [p], outputs=[[7, 7]], sampler=sampler).token_ids == [2]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [ignoring], outputs=[[7]], sampler=sampler).token_ids == [2]


def test_a_seeded_row_is_independent_of_the_batch_around_it() -> None:
    target = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=1234, repetition_penalty=1.1
    )
    others = [SamplingParams(temperature=0), SamplingParams(seed=7), SamplingParams(top_p=0.5)]
    steps = 12
    step_logits = [random_logits(1, seed=100 + s)[0] for s in range(steps)]

    def run(batched: bool) -> list[int]:
        gen, other_gens, history = make_generator(target.seed), [None, make_generator(7), None], []
        for s, row in enumerate(step_logits):
            if not batched:
                out = sample(row[None], [target], [gen], [list(history)], [[1, 2, 3]])
                history.append(out.token_ids[0])
                continue
            position = s % 4  # the target moves around a batch whose other rows change every step
            logits = random_logits(4, seed=1000 + s)
            logits[position] = row
            params = others[:position] + [target] + others[position:]
            gens = other_gens[:position] + [gen] + other_gens[position:]
            outs = [[s % 5] * s for _ in range(4)]
            outs[position] = list(history)
            prompts = [[9, 9]] * 4
            prompts[position] = [1, 2, 3]
            history.append(sample(logits, params, gens, outs, prompts).token_ids[position])
        return history

    alone = run(batched=False)
    assert run(batched=True) == alone
    assert run(batched=False) == alone  # and across runs


def test_different_seeds_and_sample_indices_give_different_streams() -> None:
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=5)]

    def stream(gen: torch.Generator | None) -> list[int]:
        return [sample(logits, params, [gen]).token_ids[0] for _ in range(5)]

    assert stream(make_generator(5)) == stream(make_generator(5))
    assert stream(make_generator(5)) != stream(make_generator(6))
    assert stream(make_generator(5, sample_index=1)) == stream(make_generator(6))
    assert make_generator(None) is None
    assert make_generator(-1).initial_seed() == 2**64 - 1


def _chi_square(draws: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(draws), minlength=probs.numel()).double()
    expected = probs.double() * len(draws)
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with 4 degrees of freedom; the draws are seeded, so no flakes.
CHI2_4DOF_P999 = 18.47


def test_temperature_sampling_follows_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    temperature = 0.7
    expected = torch.softmax(logits / temperature, dim=-1)
    params = SamplingParams(temperature=temperature)

    torch.manual_seed(0)  # unseeded rows: one vectorised draw from the global RNG
    unseeded = sample(logits.repeat(20000, 1), [params] * 20000).token_ids
    assert _chi_square(unseeded, expected) < CHI2_4DOF_P999

    gen = make_generator(0)  # a seeded row: one draw per step from its own generator
    seeded = [sample(logits[None], [params], [gen]).token_ids[0] for _ in range(2000)]
    assert _chi_square(seeded, expected) < CHI2_4DOF_P999


def test_top_k_sampling_follows_the_renormalised_top_k() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0])
    torch.manual_seed(1)
    draws = sample(logits.repeat(20000, 1), [SamplingParams(top_k=5)] * 20000).token_ids
    assert max(draws) <= 4
    assert _chi_square(draws, torch.softmax(logits[:5], dim=-1)) < CHI2_4DOF_P999


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = random_logits(3, seed=3)
    params = [
        SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=1.5, seed=1),
        SamplingParams(),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = sample(logits, params, [make_generator(1), None, None], outputs=[[0, 1, 2]] * 3)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    first, third = out.logprobs[0], out.logprobs[2]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item())
    assert first.rank == int((raw[0] > raw[0, first.token_id]).sum()) + 1
    top_lp, top_ids = raw[0].topk(5)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(top_lp.tolist())
    assert third.top == [] and third.rank == 1 and third.token_id == int(logits[2].argmax())
    assert math.isclose(third.logprob, raw[2].max().item(), rel_tol=1e-6)


def test_mismatched_batch_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"logits for 2 rows but per-row inputs of lengths \{'params': 1\}"):
        Sampler()(torch.zeros(2, 4), [SamplingParams()], [None, None], [[], []], [[], []])
    with pytest.raises(ValueError, match=r"shape \[rows, vocab\], got \(4,\)"):
        Sampler()(torch.zeros(4), [SamplingParams()], [None], [[]], [[]])


def _reference_allowed(logits: list[float], p: SamplingParams) -> set[int]:
    """The tokens a request may draw, by the definitions, in float64 Python.

    Order-free: a token survives top_k / top_p by what is clearly more probable than it. Each
    boundary is widened by a relative 1e-4, so float32 rounding in the sampler (or which of two
    near-tied tokens it ranks first) cannot make a legitimately kept token look like a violation.
    """
    slack = 1e-4
    scaled = [x / p.temperature for x in logits]
    probs = [math.exp(x - max(scaled)) for x in scaled]
    probs = [q / sum(probs) for q in probs]
    alive = [i for i in range(len(probs)) if probs[i] >= p.min_p * max(probs) * (1 - slack)]

    def above(i: int, among: list[int]) -> list[int]:
        return [j for j in among if probs[j] > probs[i] * (1 + slack)]

    if p.top_k > 0:
        alive = [i for i in alive if len(above(i, alive)) < p.top_k]
    if p.top_p < 1:
        mass = sum(probs[i] for i in alive)
        alive = [i for i in alive if sum(probs[j] for j in above(i, alive)) < p.top_p * mass * (1 + slack)]
    return set(alive)


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5, width=32), min_size=2, max_size=12),
    temperature=st.floats(0.1, 2.0),
    top_k=st.integers(-1, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**32),
)
def test_drawn_tokens_survive_every_filter(logits, temperature, top_k, top_p, min_p, seed) -> None:
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    row = torch.tensor([logits])
    allowed = _reference_allowed(row[0].tolist(), p)
    gen = make_generator(seed)
    draws = {sample(row, [p], [gen]).token_ids[0] for _ in range(5)}
    assert draws <= allowed
