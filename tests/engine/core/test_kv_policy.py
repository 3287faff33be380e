"""The contiguous policies change how much memory is held, never which tokens come out."""

import random

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine import InvalidRequestError
from pagedkv.engine.core.kv_policy import (
    CONTIGUOUS,
    CONTIGUOUS_ORACLE,
    KV_POLICIES,
    PAGED,
    POLICY_NAMES,
    KVPolicy,
)
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("policy"), "qwen2")


def _prompts():
    rng = random.Random(3)
    return [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (5, 23, 40, 11)]


def test_outputs_are_identical_under_every_policy(model_path):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=2, ignore_eos=True)
    results = {}
    for policy in ("paged", "contiguous", "contiguous-oracle"):
        llm = LLM(
            str(model_path),
            dtype="float32",
            num_kv_blocks=64,
            block_size=8,
            max_model_len=128,
            kv_policy=policy,
        )
        outs = llm.generate(_prompts() + _prompts()[:1], [greedy] * 4 + [sampled], use_tqdm=False)
        results[policy] = [[c.token_ids for c in o.outputs] for o in outs]
        assert llm.kv_stats()["blocks_used"] == 0
    assert results["paged"] == results["contiguous"] == results["contiguous-oracle"]


def test_contiguous_reserves_max_model_len_up_front(model_path):
    llm = LLM(str(model_path), num_kv_blocks=64, block_size=8, max_model_len=128, kv_policy="contiguous")
    engine = llm.engine
    engine.add_request("a", _prompts()[0], SamplingParams(max_tokens=4))
    engine.step()
    assert engine.kv_manager.usage().used_blocks == 128 // 8
    oracle = LLM(
        str(model_path), num_kv_blocks=64, block_size=8, max_model_len=128, kv_policy="contiguous-oracle"
    )
    oracle.engine.add_request("a", _prompts()[0], SamplingParams(max_tokens=20))
    oracle.engine.step()
    assert oracle.engine.kv_manager.usage().used_blocks == -(-(5 + 20) // 8)


def test_contiguous_rejects_what_it_cannot_reserve(model_path):
    llm = LLM(str(model_path), num_kv_blocks=8, block_size=8, max_model_len=128, kv_policy="contiguous")
    with pytest.raises(InvalidRequestError, match="128 tokens need 16 blocks"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_unknown_policy_is_rejected(model_path):
    with pytest.raises(ValueError, match="kv_policy must be one of"):
        LLM(str(model_path), num_kv_blocks=8, kv_policy="virtual")


def test_each_policy_is_one_object_with_its_reservation():
    paged, contiguous, oracle = (KVPolicy.named(name) for name in POLICY_NAMES)
    assert (paged, contiguous, oracle) == (PAGED, CONTIGUOUS, CONTIGUOUS_ORACLE)
    assert KVPolicy.named(CONTIGUOUS) is CONTIGUOUS
    # prompt 5, max_tokens 20, max_model_len 128
    assert [p.reserved_tokens(5, 20, 128) for p in KV_POLICIES] == [0, 128, 25]
    assert [p.peak_tokens(5, 20, 128) for p in KV_POLICIES] == [25, 128, 25]
    assert [p.shares_blocks for p in KV_POLICIES] == [True, False, False]
    assert [p.allows_prefix_caching for p in KV_POLICIES] == [True, False, False]
