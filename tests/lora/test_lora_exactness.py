"""LoRA adapters give PEFT's tokens: several adapters and the base model mixed in one
``generate`` call, on a tiny checkpoint and on the real model, in float32 greedy decoding.

The adapters are made by PEFT itself with seeded non-zero ``A`` and ``B``; each test first
checks that the adapters change the tokens (else equality would prove nothing)."""

import random

import pytest

from pagedkv import LLM, LoRARequest, SamplingParams
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.lora_adapters import adapter_and_references, make_adapter, peft_greedy
from tests.real_model import ENGINE_OPTIONS

MAX_NEW = 8


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (3, 11, 26)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A checkpoint, three adapters (all targets rank 4; q/v/down rank 8; rsLoRA on o/gate/up)
    and PEFT's tokens for each, and transformers' for the base model."""
    tmp = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(tmp, "llama")
    adapters = {
        "all": make_adapter(tmp / "all", base, seed=1),
        "qv-down": make_adapter(tmp / "qvd", base, seed=2, rank=8, targets=("q_proj", "v_proj", "down_proj")),
        "rslora": make_adapter(
            tmp / "rs", base, seed=3, targets=("o_proj", "gate_proj", "up_proj"), use_rslora=True
        ),
    }
    prompts = _prompts()
    expected = {name: peft_greedy(base, folder, prompts, MAX_NEW) for name, folder in adapters.items()}
    expected[None] = peft_greedy(base, None, prompts, MAX_NEW)
    return base, adapters, prompts, expected


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("max_loras", [1, 3])
def test_mixed_adapters_and_base_in_one_call_equal_peft(case, max_loras):
    """With one slot the three adapters take turns (the others wait); with three they share steps."""
    base, adapters, prompts, expected = case
    for name in adapters:
        assert expected[name] != expected[None], f"adapter {name} does not change the tokens"
    requests = {
        name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(adapters.items())
    }
    order = [None, "all", "qv-down", None, "rslora", "all"]
    with LLM(
        str(base),
        dtype="float32",
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=8,
        num_kv_blocks=256,
        max_num_batched_tokens=24,  # prompts in chunks, beside other adapters' decodes
    ) as llm:
        outs = llm.generate(
            [p for _ in order for p in prompts],
            GREEDY,
            lora_request=[None if n is None else requests[n] for n in order for _ in prompts],
            use_tqdm=False,
        )
        residency = llm.engine.scheduler.adapters
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [t for n in order for t in expected[n]]
    assert residency.evictions == (0 if max_loras == 3 else residency.loads - 1)


def test_prefix_cache_is_not_shared_across_adapters(case):
    base, adapters, prompts, expected = case
    prompt = prompts[2]  # 26 tokens: one full block of 16 to share
    lora = LoRARequest("all", 1, str(adapters["all"]))
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64) as llm:
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        adapted = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0]
        again = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[None][2]
    assert adapted.num_cached_tokens == 0  # the base model's block is not the adapter's
    assert adapted.outputs[0].token_ids == expected["all"][2]
    assert again.num_cached_tokens == 16  # the adapter's own block is
    assert again.outputs[0].token_ids == expected["all"][2]


def test_real_model_adapter_equals_peft(real_model, tmp_path):
    prompts = [[1, 504, 3458, 314, 260, 3575, 282, 4649, 47]]
    targets = ("q_proj", "v_proj", "down_proj")
    adapter, expected, plain = adapter_and_references(
        tmp_path / "adapter", real_model, 5, prompts, 6, rank=8, targets=targets
    )
    assert expected != plain
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(str(real_model), **ENGINE_OPTIONS, enable_lora=True, max_lora_rank=8) as llm:
        lora = LoRARequest("real", 1, str(adapter))
        outs = llm.generate(prompts * 2, params, lora_request=[lora, None], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[0], plain[0]]


def test_beam_search_and_samples_keep_their_adapter(case):
    """Beams and ``n`` samples fork from the prompt's sequence: every fork runs its adapter."""
    import peft
    import torch
    import transformers

    from pagedkv import BeamSearchParams
    from tests.engine.sample.test_beam_search import reference_beam_search

    base, adapters, prompts, expected = case
    lora = LoRARequest("all", 1, str(adapters["all"]))
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    peft_model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters["all"]
    )
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=256) as llm:
        [beams] = llm.beam_search([prompts[1]], params, use_tqdm=False, lora_request=lora)
        n_greedy = SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        [samples] = llm.generate([prompts[1]], n_greedy, lora_request=lora, use_tqdm=False)
    reference = reference_beam_search(base, prompts[1], params, model=peft_model)
    assert [c.token_ids for c in beams.outputs] == [h.token_ids for h in reference]
    assert [c.token_ids for c in samples.outputs] == [expected["all"][1]] * 2


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_other_families_equal_peft(tmp_path, arch):
    """Qwen3 (q/k norms after the adapted q/k projections) and Gemma 2 (GeGLU: the adapter's
    output joins the gate/up product before the activation)."""
    base = make_checkpoint(tmp_path, arch)
    prompts = _prompts()[:2]
    adapter, expected, plain = adapter_and_references(tmp_path / "adapter", base, 4, prompts, MAX_NEW)
    assert expected != plain
    lora = LoRARequest("a", 1, str(adapter))
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=128) as llm:
        outs = llm.generate(prompts * 2, GREEDY, lora_request=[lora, lora, None, None], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected + plain
