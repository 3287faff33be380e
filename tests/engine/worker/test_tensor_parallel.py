"""tensor_parallel_size 2 (two processes on gloo) gives the tokens tensor_parallel_size 1 gives.

Each rank holds half the heads, half the MLP rows and half the vocabulary; the sums the single
device does in one GEMM are split in two and added by an all-reduce, so the logits differ in the
last bits only (within 1e-5 in float32) and greedy tokens are the same -- on every test
checkpoint (grouped-query, tied, sliding window, biases, q/k norm, fewer KV heads than ranks with
a vocabulary that does not split evenly), and under preemption, prefix caching, n > 1 and beam
search. Spawning a rank costs an interpreter and a torch import, so the scenario tests share one
pair of engines.
"""

import random
import re

import pytest
import torch

from pagedkv import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedkv.engine import RequestLimits
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.engine.plans import Piece, plan_of
from tests.engine.test_engine_exactness import CASES as EXACTNESS_CASES

CASES = {
    **EXACTNESS_CASES,
    # one KV head for two ranks: replicated; 515 rows: the second rank's vocabulary is padded
    "llama-mqa-odd-vocab": ("llama", {"num_key_value_heads": 1, "vocab_size": 515}),
    # fused qkv_proj / gate_up_proj: each rank reads its rows of every part
    "phi3-fused": ("phi3", {}),
    # query/key heads reordered for partial rotary: each rank's whole heads
    "phi3-partial-rotary": ("phi3", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.75}}),
    # each rank holds its rows of every expert (and of Qwen2-MoE's shared one), one all-reduce a layer
    "mixtral": ("mixtral", {"num_local_experts": 4}),
    "qwen2moe-shared-dense-layer": (
        "qwen2moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
        },
    ),
    # sandwich norms, GeGLU, soft-caps, tied and scaled embeddings; two KV groups (hybrid paging)
    "gemma2-hybrid": (
        "gemma2",
        {
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "num_hidden_layers": 4,
        },
    ),
    # 1 + w q/k norms, the sliding layers' own rotary table; three KV groups
    "gemma3-hybrid": (
        "gemma3",
        {
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    ),
}
#: the cases paged by KV group (hybrid paging) on one rank and on two: their groups
HYBRID = {"gemma2-hybrid": 2, "gemma3-hybrid": 3}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths, two sharing a 40-token prefix so the prefix cache hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(40)]
    prompts = [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (3, 17, 33, 48)]
    return [*prompts, shared + [5, 6, 7], shared + [9]]


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def _pair(path, **options) -> tuple[LLM, LLM]:
    """float32 unless asked: the exactness reference (dtype "auto" is bfloat16 on this CPU)."""
    options = {"dtype": "float32", **options}
    return LLM(str(path), **options), LLM(str(path), tensor_parallel_size=2, **options)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_logits_and_greedy_tokens_of_one(tmp_path, case):
    arch, overrides = CASES[case]
    path = make_checkpoint(tmp_path, arch, **overrides)
    groups = HYBRID.get(case, 1)
    # a small token budget: longer prompts are prefilled in chunks, interleaved with decodes
    one, two = _pair(path, block_size=4, num_kv_blocks=128 * groups, max_num_batched_tokens=20)
    try:
        prompts = _prompts()
        # the prompts' last-token logits in one step, each prompt in its own blocks (fresh pools);
        # with KV groups a table interleaves the groups' (16 blocks each), past the null block 0
        width = 16 * groups
        tables = [list(range(1 + width * i, 1 + width * (i + 1))) for i in range(len(prompts))]
        plan = plan_of([Piece(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
        expected, got = one.engine.executor.execute(plan), two.engine.executor.execute(plan)
        assert got.shape == expected.shape == (len(prompts), one.engine.model_config.vocab_size)
        # 1e-5 absolute, or relative where logits are large (the tied checkpoints' reach ~60,
        # where float32 itself only resolves 4e-6)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert _tokens(two.generate(prompts, GREEDY, use_tqdm=False)) == _tokens(
            one.generate(prompts, GREEDY, use_tqdm=False)
        )
        assert two.kv_stats()["prefix_cache_hits_tokens"] > 0
        assert two.kv_stats()["blocks_used"] == 0
        if case in HYBRID:
            paged = f"{groups} KV groups"
            assert paged in repr(one) and paged in repr(two)
    finally:
        two.engine.shutdown()


def test_two_ranks_read_quantized_blocks_as_one_does(tmp_path):
    """int8 KV blocks: each rank quantizes its own KV heads with their own per-token scales, the
    scales one rank would compute for those heads, so the tokens are those of one rank."""
    path = make_checkpoint(tmp_path, "llama")
    one, two = _pair(path, block_size=4, num_kv_blocks=64, kv_cache_dtype="int8")
    try:
        prompts = _prompts(seed=1)
        assert _tokens(two.generate(prompts, GREEDY, use_tqdm=False)) == _tokens(
            one.generate(prompts, GREEDY, use_tqdm=False)
        )
        stats = two.kv_stats()
        assert stats["kv_cache_dtype"] == "int8"
        # each rank holds half the KV heads of every block: half the bytes of one rank's pool
        assert stats["kv_cache_bytes"] * 2 == one.kv_stats()["kv_cache_bytes"]
        assert stats["blocks_used"] == 0
    finally:
        two.engine.shutdown()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One engine per size over a pool small enough to preempt (16 blocks of 4 tokens), with a
    request budget above it (the default, what the pool holds, refuses three samples of 23)."""
    path = make_checkpoint(tmp_path_factory.mktemp("tp"), "llama")
    budget = RequestLimits(max_request_tokens=4096)
    one, two = _pair(path, block_size=4, num_kv_blocks=16, watermark=0.0, decode_headroom=0.0, limits=budget)
    yield one, two
    two.engine.shutdown()


def test_preemption_and_prefix_caching_change_nothing(pair):
    one, two = pair
    expected = _tokens(one.generate(_prompts(), GREEDY, use_tqdm=False))
    assert _tokens(two.generate(_prompts(), GREEDY, use_tqdm=False)) == expected
    stats = two.kv_stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits_tokens"] > 0
    assert stats["blocks_used"] == 0


def test_n_samples_and_beams_are_the_same(pair):
    one, two = pair
    prompts = _prompts(1)[:2]  # 3 and 17 tokens: three samples or beams each fit the pool
    # seeded sampling: the same draws, on logits that agree to 1e-5
    sampled = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    assert _tokens(two.generate(prompts, sampled, use_tqdm=False)) == _tokens(
        one.generate(prompts, sampled, use_tqdm=False)
    )
    beams = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    assert _tokens(two.beam_search(prompts, beams, use_tqdm=False)) == _tokens(
        one.beam_search(prompts, beams, use_tqdm=False)
    )
    assert two.kv_stats()["blocks_used"] == 0


def test_constrained_outputs_are_the_same(pair):
    """Grammar state lives on the driver with the sampler: the ranks only compute the logits it masks."""
    one, two = pair
    regex = "[a-d]{2,6}"
    params = SamplingParams(
        n=2, max_tokens=8, temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    prompts = _prompts(2)[:2]
    expected = one.generate(prompts, params, use_tqdm=False)
    got = two.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert all(re.fullmatch(regex, c.text) for out in got for c in out.outputs)
    assert two.kv_stats()["blocks_used"] == 0
