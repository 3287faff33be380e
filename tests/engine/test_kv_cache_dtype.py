"""The engine on quantized KV blocks (``kv_cache_dtype`` fp8 and int8).

Quantization changes the numbers, so these tests do not compare with transformers; they compare
paths that must give the same tokens because they store and read the very same quantized bytes:
with and without the prefix cache, with and without preemption, one sample vs n forked samples
(copy-on-write must carry the scales), the reference vs the native kernel. Every block returns.
"""

from __future__ import annotations

import random

import pytest

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.attention.backends import BACKENDS, Backend
from pagedkv.engine import RequestLimits
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint

QUANTIZED = ["fp8", "int8"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kvquant"), "llama")


def _prompts() -> list[list[int]]:
    """Mixed lengths, two sharing a 24-token prefix (the prefix cache hits when chunked prefill
    computes the first before the second is admitted)."""
    rng = random.Random(5)
    shared = [rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(24)]
    prompts = [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (3, 14, 29)]
    return [*prompts, shared + [5, 6], shared + [7]]


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def _assert_all_returned(llm: LLM) -> None:
    stats = llm.kv_stats()
    assert stats["blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_prefix_caching_preemption_and_kernels_agree(model_path, kv_cache_dtype):
    def run(**options):
        options = {
            "dtype": "float32",
            "block_size": 4,
            "max_num_batched_tokens": 16,
            "kv_cache_dtype": kv_cache_dtype,
        } | options
        llm = LLM(str(model_path), **options)
        outputs = _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False))
        _assert_all_returned(llm)
        return outputs, llm.kv_stats()

    cached, stats = run(num_kv_blocks=256)
    assert stats["prefix_cache_hits_tokens"] > 0 and stats["kv_cache_dtype"] == kv_cache_dtype
    uncached, _ = run(num_kv_blocks=256, enable_prefix_caching=False)
    # no decode headroom: admit on the prompt alone, so the tiny pool must preempt
    tight, tight_stats = run(num_kv_blocks=16, watermark=0.0, decode_headroom=0.0)
    reference, _ = run(num_kv_blocks=256, attention_backend="torch")
    assert tight_stats["preemptions"] > 0
    assert cached == uncached == tight == reference


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_forked_samples_read_the_copied_scales(model_path, kv_cache_dtype):
    """n greedy samples fork one block table; the partial last prompt block is copied on the
    first divergent write, scales included, so every sample equals the single one."""
    llm = LLM(
        str(model_path), dtype="float32", block_size=4, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype
    )
    prompts = _prompts()[1:3]  # 14 and 29 tokens: both end inside a block
    single = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    params = SamplingParams(n=3, max_tokens=10, temperature=0.0, ignore_eos=True)
    forked = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert forked == [[s[0]] * 3 for s in single]
    _assert_all_returned(llm)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_beams_survive_preemption(model_path, kv_cache_dtype):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    prompts = _prompts()[:2]
    options = {"dtype": "float32", "block_size": 4, "kv_cache_dtype": kv_cache_dtype}
    roomy = LLM(str(model_path), num_kv_blocks=256, **options)
    # no decode headroom: admit on the prompt alone, so the tiny pool must preempt (and a budget
    # above the pool, which holds less than the three beams)
    budget = RequestLimits(max_request_tokens=4096)
    tight = LLM(
        str(model_path), num_kv_blocks=12, watermark=0.0, decode_headroom=0.0, limits=budget, **options
    )
    expected = _tokens(roomy.beam_search(prompts, params, use_tqdm=False))
    assert _tokens(tight.beam_search(prompts, params, use_tqdm=False)) == expected
    assert all(len(beams) == 3 for beams in expected)
    assert tight.kv_stats()["preemptions"] > 0
    _assert_all_returned(tight)
    _assert_all_returned(roomy)


def test_the_same_memory_holds_more_tokens(model_path):
    auto = LLM(str(model_path), dtype="float32", kv_cache_memory="1MiB", block_size=16).kv_stats()
    fp8 = LLM(
        str(model_path), dtype="float32", kv_cache_memory="1MiB", block_size=16, kv_cache_dtype="fp8"
    ).kv_stats()
    # float32 model: 4 bytes per element vs 1 byte plus a 4-byte scale per head_dim elements
    assert auto["kv_cache_dtype"] == "auto" and fp8["kv_cache_dtype"] == "fp8"
    assert fp8["bytes_per_token"] < auto["bytes_per_token"] / 3
    assert fp8["blocks_total"] > 3 * auto["blocks_total"]
    assert fp8["kv_cache_bytes"] <= 2**20 and auto["kv_cache_bytes"] <= 2**20


def test_bad_kv_cache_dtypes_fail_before_loading(model_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'e5m2'"):
        LLM(str(model_path), kv_cache_dtype="e5m2")
    # every shipped backend reads every dtype; one that reads only unquantized blocks is refused
    reference = BACKENDS["torch"]
    monkeypatch.setitem(BACKENDS, "plain", Backend("plain", reference.decode, reference.prefill, ("auto",)))
    with pytest.raises(ValueError, match="'plain' attention backend cannot read kv_cache_dtype='fp8'"):
        LLM(str(model_path), kv_cache_dtype="fp8", attention_backend="plain")


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_the_second_tier_moves_quantized_blocks_with_their_scales(model_path, kv_cache_dtype, tmp_path):
    """Spilled, loaded, swapped and restarted blocks carry their scales: the tokens are those of
    a pool that never lets a block go."""
    options = {"dtype": "float32", "block_size": 4, "kv_cache_dtype": kv_cache_dtype}
    roomy = LLM(str(model_path), num_kv_blocks=256, **options)
    expected = _tokens(roomy.generate(_prompts(), GREEDY, use_tqdm=False))
    tight = options | {"num_kv_blocks": 16, "watermark": 0.0, "decode_headroom": 0.0}
    host = LLM(str(model_path), kv_offload="host", kv_offload_memory="1MiB", preemption_mode="swap", **tight)
    for _ in range(2):  # the second pass loads the prompts' prefixes from the tier
        assert _tokens(host.generate(_prompts(), GREEDY, use_tqdm=False)) == expected
    stats = host.kv_stats()
    assert stats["preemptions_swapped"] > 0 and stats["tier_hits_tokens"] > 0
    _assert_all_returned(host)
    disk = tight | {"kv_offload": "disk", "kv_offload_memory": "1MiB", "kv_offload_dir": tmp_path}
    with LLM(str(model_path), **disk) as first:
        assert _tokens(first.generate(_prompts(), GREEDY, use_tqdm=False)) == expected
    with LLM(str(model_path), **disk) as restarted:
        assert _tokens(restarted.generate(_prompts(), GREEDY, use_tqdm=False)) == expected
        assert restarted.kv_stats()["tier_hits_tokens"] > 0
        _assert_all_returned(restarted)
