"""LoRA adapters on Phi-3-style models, whose checkpoints fuse q/k/v into ``qkv_proj`` and
gate/up into ``gate_up_proj``: PEFT's adapters of them target those fused modules (one ``A``
over the hidden size, one ``B`` over every output row), and Phi-4-mini rotates only part of each
head (its query and key rows are reordered on load, so the adapter's ``B`` rows must be too).

Float32 greedy tokens equal PEFT's with two adapters and the base model mixed in one call, in
both paging modes and on two tensor-parallel ranks. The adapters are made by PEFT itself with
seeded non-zero ``A`` and ``B``; each test first checks that they change the tokens."""

import json
import random

import pytest

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.engine import InvalidRequestError
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.lora_adapters import make_adapter, peft_greedy

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
#: every module transformers' Phi3 decoder layer has
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MODELS = {
    "phi3": {"max_position_embeddings": 64},
    # one KV head: two tensor-parallel ranks cut the same k/v rows of the fused B
    "phi3-one-kv-head": {"max_position_embeddings": 64, "num_key_value_heads": 1},
    # Phi-4-mini's rotary share: 12 of 16 dimensions (plain RoPE: transformers' longrope switches
    # factors with a sequence's length, which the tokens of short prompts would show)
    "phi4-mini-partial-rotary": {"max_position_embeddings": 64, "partial_rotary_factor": 0.75},
}
ORDER = ["all", None, "qkv-up", "all"]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (3, 11, 26)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per model: the checkpoint, two adapters (every module at rank 4; the fused ones alone
    at rank 8) and PEFT's tokens for each and transformers' for the base model."""
    built = {}
    prompts = _prompts()
    for name, overrides in MODELS.items():
        tmp = tmp_path_factory.mktemp(name)
        base = make_checkpoint(tmp, "phi3", **overrides)
        adapters = {
            "all": make_adapter(tmp / "all", base, seed=1, targets=PHI3_TARGETS),
            "qkv-up": make_adapter(
                tmp / "qkv-up", base, seed=2, rank=8, targets=("qkv_proj", "gate_up_proj")
            ),
        }
        expected = {a: peft_greedy(base, folder, prompts, MAX_NEW) for a, folder in adapters.items()}
        expected[None] = peft_greedy(base, None, prompts, MAX_NEW)
        for adapter in adapters:
            assert expected[adapter] != expected[None], f"adapter {adapter} does not change the tokens"
        built[name] = base, adapters, expected
    return prompts, built


def _generate(base, adapters, prompts, **options) -> list[list[int]]:
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    with LLM(
        str(base),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=128,
        max_num_batched_tokens=24,  # prompts in chunks, beside other adapters' decodes
        **options,
    ) as llm:
        outs = llm.generate(
            [p for _ in ORDER for p in prompts],
            GREEDY,
            lora_request=[None if n is None else requests[n] for n in ORDER for _ in prompts],
            use_tqdm=False,
        )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("paging", ["unified", "slots"])
@pytest.mark.parametrize("model", ["phi3", "phi4-mini-partial-rotary"])
def test_fused_targets_with_mixed_adapters_equal_peft(cases, model, paging):
    prompts, built = cases
    base, adapters, expected = built[model]
    got = _generate(base, adapters, prompts, lora_paging=paging)
    assert got == [t for n in ORDER for t in expected[n]]


@pytest.mark.parametrize("model", ["phi3-one-kv-head", "phi4-mini-partial-rotary"])
def test_two_ranks_cut_the_fused_b_by_their_rows_of_q_k_v_and_equal_one(cases, model):
    """A rank's ``qkv_proj`` holds its query rows, then its key rows, then its value rows: the
    fused ``B`` is cut into those three pieces (with one KV head both ranks take its rows)."""
    prompts, built = cases
    base, adapters, expected = built[model]
    got = {
        size: _generate(base, adapters, prompts, lora_paging="slots", tensor_parallel_size=size)
        for size in (1, 2)
    }
    assert got[2] == [t for n in ORDER for t in expected[n]]
    assert got[2] == got[1]


def _retargeted(tmp_path, adapter, targets):
    """A copy of ``adapter`` whose config names ``targets``."""
    folder = tmp_path / "retargeted"
    folder.mkdir()
    for file in adapter.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"target_modules": targets}))
    return folder


def test_split_targets_on_a_fused_checkpoint_are_refused_by_name(cases, tmp_path):
    """transformers' Phi-3 has no ``q_proj``: an adapter naming it was made for another model."""
    prompts, built = cases
    base, adapters, expected = built["phi3"]
    split = _retargeted(tmp_path, adapters["all"], ["q_proj", "v_proj"])
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64) as llm:
        with pytest.raises(InvalidRequestError, match=r"\['q_proj', 'v_proj'\] are not supported on Phi3"):
            llm.generate(
                prompts[:1], GREEDY, lora_request=LoRARequest("split", 1, str(split)), use_tqdm=False
            )
        [out] = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # and it serves on
    assert out.outputs[0].token_ids == expected[None][0]


def test_fused_targets_on_a_split_checkpoint_are_refused_by_name(cases, tmp_path):
    prompts, built = cases
    base, adapters, _ = built["phi3"]
    llama = make_checkpoint(tmp_path, "llama")
    fused = _retargeted(tmp_path, adapters["all"], list(PHI3_TARGETS))
    with LLM(str(llama), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64) as llm:
        with pytest.raises(InvalidRequestError, match=r"'qkv_proj'\] are not supported on LlamaForCausalLM"):
            llm.generate(
                prompts[:1], GREEDY, lora_request=LoRARequest("fused", 1, str(fused)), use_tqdm=False
            )


def test_a_fused_target_is_one_block_over_all_its_modules_columns(cases):
    """One ``A`` of rank r per fused module (one shrink, as PEFT's), its ``B`` over every row."""
    from pagedkv.models import load_model
    from pagedkv.models.lora import LoRASlots

    _, built = cases
    slots = LoRASlots(load_model(built["phi3"][0], attention_backend="torch"), max_loras=2, max_rank=8)
    qkv, gate_up = slots.modules[0, "qkv_proj"], slots.modules[0, "gate_up_proj"]
    assert qkv.columns.tolist() == [0, 64 + 32 + 32] and qkv.a.shape == (2, 8, 64)
    assert gate_up.columns.tolist() == [0, 2 * 128] and gate_up.a.shape == (2, 8, 64)
