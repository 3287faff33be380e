"""Hybrid paging in the live engine: sliding-window layers keep only the blocks their window
still reads, and the greedy tokens do not move -- hybrid on equals hybrid off equals
transformers, in float32, through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedkv import LLM, SamplingParams
from pagedkv.models.step_program import StepProgram
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint

WINDOW = 8
MAX_NEW = 24
#: Gemma 2 (alternating), Gemma 3 (two sliding layers to one full), Mistral (every layer windowed)
FAMILIES = {
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "num_hidden_layers": 4},
    "gemma3": {
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    "mistral": {"sliding_window": WINDOW},
    # the first layer full, the second sliding
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
}
GROUPS = {
    "gemma2": "2 KV groups of 2 layers",
    "gemma3": "3 KV groups of 1 layers",
    "mistral": "1 KV groups",
    "qwen2": "2 KV groups of 1 layers",
}


def _prompts() -> list[list[int]]:
    """Longer than the window; two share a 24-token prefix (a prefix hit past the window)."""
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(4, TEST_VOCAB_SIZE, (24,), generator=gen).tolist()
    own = [torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (5, 21, 33)]
    return [*own, shared + [5, 6, 7], shared + [9]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def reference(request, tmp_path_factory):
    arch = request.param
    path = make_checkpoint(tmp_path_factory.mktemp(arch), arch, **FAMILIES[arch])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for prompt in _prompts():
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, max_new_tokens=MAX_NEW, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return arch, path, outs


def _generate(path, block_size: int, num_kv_blocks: int, hybrid: bool, **options) -> tuple[LLM, list]:
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=12,
        disable_hybrid_kv_cache_manager=not hybrid,
        **options,
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hybrid", [True, False])
def test_greedy_tokens_equal_transformers(reference, block_size, hybrid):
    """Chunked prefill interleaved with decodes past the window, prefix-cache hits."""
    arch, path, expected = reference
    llm, tokens = _generate(path, block_size, 2048 // block_size, hybrid)
    assert tokens == expected
    described = repr(llm)
    assert (GROUPS[arch] in described) if hybrid else ("off (disable_hybrid_kv_cache_manager)" in described)
    stats = llm.kv_stats()
    assert stats["prefix_cache_hits_tokens"] > 0
    assert stats["blocks_used"] == 0


@pytest.mark.parametrize("reference", ["qwen2", "mistral"], indirect=True)
def test_windowed_models_decode_on_the_c_stack_with_hybrid_paging(reference):
    """The C decode stack reads each layer's KV group's tables: with hybrid paging on, every
    decode step of a windowed Qwen2 (two groups) or Mistral (one) runs in it, exactly."""
    arch, path, expected = reference
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=512, max_num_batched_tokens=12)
    assert GROUPS[arch] in repr(llm)
    assert llm.engine.executor.runtime["decode layers"] == "C stack"
    model = llm.engine.executor.runner.model
    model.step_program = StepProgram.of(model)
    stack, taken = model.step_program.stack, []
    run = stack.run

    def recording(*args):
        hidden = run(*args)
        taken.append(hidden is not None)
        return hidden

    stack.run = recording
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # the steps past every prompt: the last MAX_NEW - 1 at least, each in the stack
    assert sum(taken) >= MAX_NEW - 1


@pytest.mark.parametrize("reference", ["gemma2", "gemma3"], indirect=True)
@pytest.mark.parametrize("block_size", [1, 4])
def test_preemption_under_a_tight_pool_keeps_the_tokens(reference, block_size):
    """A pool too small for every sequence at once: sequences are preempted, recomputed (on
    prefix hits of their windows where still cached) and still end with transformers' tokens.
    (Mistral, every layer windowed, holds a window per sequence once past its prompt: it grows
    by nothing, and such a pool preempts nothing.)"""
    _, path, expected = reference
    tight = {"watermark": 0.0, "decode_headroom": 0.0}
    llm, tokens = _generate(path, block_size, 160 // block_size, True, **tight)
    assert tokens == expected
    stats = llm.kv_stats()
    assert stats["preemptions"] > 0 and stats["blocks_used"] == 0


def test_blocks_out_of_the_window_return_to_the_pool(tmp_path):
    """One long generation: with hybrid paging the pool holds the full layers' blocks and a
    window's worth of the sliding layers', without it every block of both."""
    path = make_checkpoint(tmp_path, "gemma2", **FAMILIES["gemma2"])
    held = {}
    for hybrid in (True, False):
        llm = LLM(
            str(path),
            dtype="float32",
            block_size=4,
            num_kv_blocks=256,
            disable_hybrid_kv_cache_manager=not hybrid,
        )
        engine = llm.engine
        engine.add_request(
            "long", list(range(4, 44)), SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
        )
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv_manager.usage().used_blocks)
        held[hybrid] = peak
        assert engine.kv_manager.usage().used_blocks == 0
    # 120 tokens, 30 blocks of 4. Off: one table, each block 4 layers deep. On: two groups (2 full
    # layers, 2 sliding), each block 2 layers deep: the full group's 30 and at most
    # ceil(8 / 4) + 1 sliding ones -- 66 layer-blocks of the 120.
    assert held[False] == 30
    assert 30 < held[True] <= 30 + 3
    assert held[True] * 2 <= 0.55 * held[False] * 4


@pytest.mark.parametrize("mode", ["ngram", "beam", "n2", "int8"])
def test_speculation_beams_and_samples_equal_hybrid_off(tmp_path, mode):
    """Rollbacks of rejected draft tokens, beams forking and freeing, parallel samples sharing a
    prompt and copying on write, a quantized cache (its scales grouped like the blocks): hybrid
    paging changes none of their tokens."""
    from pagedkv import BeamSearchParams

    path = make_checkpoint(tmp_path, "gemma2", **FAMILIES["gemma2"])
    gen = torch.Generator().manual_seed(3)
    prompts = [
        [5, 6, 7, 8] * 6 + torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (3, 30)
    ]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    results = []
    for hybrid in (True, False):
        llm = LLM(
            str(path),
            dtype="float32",
            block_size=4,
            num_kv_blocks=120,
            disable_hybrid_kv_cache_manager=not hybrid,
            **({"speculative_config": spec} if mode == "ngram" else {}),
            **({"kv_cache_dtype": "int8"} if mode == "int8" else {}),
        )
        if mode == "beam":
            inputs = [{"prompt_token_ids": p} for p in prompts]
            outs = llm.beam_search(inputs, BeamSearchParams(beam_width=3, max_tokens=20))
        else:
            n = 2 if mode == "n2" else 1
            params = SamplingParams(n=n, max_tokens=30, temperature=0.8 * (n > 1), seed=1, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[c.token_ids for c in out.outputs] for out in outs])
        assert llm.kv_stats()["blocks_used"] == 0
    assert results[0] == results[1]


def test_a_prompt_that_fits_no_group_layout_is_refused_and_a_long_output_is_not(tmp_path):
    """A prompt's blocks are allocated in every KV group at admission: one that the pool holds
    once but not three times is refused up front (it could never be admitted), while a short
    prompt with a long output -- a window's worth of blocks per sliding group -- runs."""
    from pagedkv.engine.validation import InvalidRequestError

    path = make_checkpoint(tmp_path, "gemma3", **FAMILIES["gemma3"])
    llm = LLM(
        str(path), dtype="float32", block_size=4, num_kv_blocks=49, watermark=0.0
    )  # 48 and the null block
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="can never fit in the KV cache"):
        llm.generate([list(range(4, 104))], params, use_tqdm=False)
    long = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([list(range(4, 14))], long, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 150
    assert llm.kv_stats()["blocks_used"] == 0
