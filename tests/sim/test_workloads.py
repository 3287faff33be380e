"""Workloads: lengths within their stated bounds, and a seed fixes every draw."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.sim.workloads import WORKLOAD_NAMES, LiveRequest, Request, Workload, poisson_arrivals


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(WORKLOAD_NAMES),
    max_seq_len=st.integers(8, 4096),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_request_fits_the_context(name, max_seq_len, seed):
    workload = Workload(name, max_seq_len=max_seq_len, prefix_len=max_seq_len // 2)
    for r in workload.sample(np.random.default_rng(seed), 200):
        assert r.prompt_len >= 1 and r.output_len >= 1
        assert r.final_len <= max_seq_len
        if name == "shared-prefix":
            assert r.shared_prefix_len == max_seq_len // 2 < r.prompt_len
        else:
            assert r.shared_prefix_len == 0


def test_normal_workload_is_the_tutorial_setting():
    requests = Workload("normal").sample(np.random.default_rng(0), 20_000)
    outputs = np.array([r.output_len for r in requests])
    prompts = np.array([r.prompt_len for r in requests])
    # Responses ~ Normal(500, 200) clipped to [200, 2048]: the clip at 200 lifts the mean a little
    # and narrows the spread.
    assert outputs.min() == 200 and outputs.max() <= 2048
    assert 500 <= outputs.mean() <= 520
    assert 180 <= outputs.std() <= 200
    assert 240 <= prompts.mean() <= 260 and prompts.min() >= 16 and prompts.max() <= 1024


def test_sharegpt_is_long_tailed():
    requests = Workload("sharegpt").sample(np.random.default_rng(0), 20_000)
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert 140 <= prompts.mean() <= 180 and 300 <= outputs.mean() <= 380
    assert np.median(prompts) < prompts.mean()  # log-normal: mean above median
    assert prompts.max() > 5 * prompts.mean()


def test_same_seed_same_requests_and_stream_matches_sample():
    workload = Workload("sharegpt")
    a = workload.sample(np.random.default_rng(7), 300)
    assert a == workload.sample(np.random.default_rng(7), 300)
    assert a != workload.sample(np.random.default_rng(8), 300)
    stream = workload.stream(np.random.default_rng(7))
    assert [next(stream) for _ in range(256)] == workload.sample(np.random.default_rng(7), 256)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "uniform"}, "unknown workload"),
        ({"max_seq_len": 2}, "max_seq_len"),
        ({"name": "shared-prefix", "max_seq_len": 100, "prefix_len": 99}, "prefix_len"),
        ({"name": "shared-prefix", "prefix_len": 0}, "prefix_len"),
    ],
)
def test_bad_workloads_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(**kwargs)


def test_live_request_must_be_within_its_life():
    LiveRequest(Request(10, 5), 15)
    with pytest.raises(ValueError, match="between its prompt"):
        LiveRequest(Request(10, 5), 9)
    with pytest.raises(ValueError, match="between its prompt"):
        LiveRequest(Request(10, 5), 16)


def test_poisson_arrivals():
    counts = poisson_arrivals(np.random.default_rng(0), 0.4, 20_000)
    assert counts.shape == (20_000,) and abs(counts.mean() - 0.4) < 0.02
    with pytest.raises(ValueError, match="arrival rate"):
        poisson_arrivals(np.random.default_rng(0), 0.0, 10)
    with pytest.raises(ValueError, match="at least one step"):
        poisson_arrivals(np.random.default_rng(0), 1.0, 0)
