"""LoRA under tensor parallelism: two ranks, each holding its shard of every adapter (``A``
whole and its rows of ``B`` on q/k/v and gate/up; its columns of ``A`` and ``B`` whole on o and
down), give PEFT's float32 greedy tokens -- and one rank's -- with two adapters and the base
model mixed in one ``generate`` call.

The adapters are made by PEFT itself with seeded non-zero ``A`` and ``B``; the test first checks
that they change the tokens (else equality would prove nothing)."""

import random

import pytest

from pagedkv import LLM, LoRARequest, SamplingParams
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.lora_adapters import make_adapter, peft_greedy

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_key_value_heads": 1}],
    ids=["gqa", "kv-head-replicated"],  # one KV head: both ranks cut the same rows of k/v's B
)
def test_two_ranks_with_mixed_adapters_equal_peft_and_one_rank(tmp_path, overrides):
    base = make_checkpoint(tmp_path, "llama", **overrides)
    adapters = {
        "all": make_adapter(tmp_path / "all", base, seed=1),
        "qv-down": make_adapter(
            tmp_path / "qvd", base, seed=2, rank=8, targets=("q_proj", "v_proj", "down_proj")
        ),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (3, 11, 26)]
    expected = {name: peft_greedy(base, folder, prompts, MAX_NEW) for name, folder in adapters.items()}
    expected[None] = peft_greedy(base, None, prompts, MAX_NEW)
    for name in adapters:
        assert expected[name] != expected[None], f"adapter {name} does not change the tokens"
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    order = ["all", None, "qv-down", "all"]
    options = {
        "dtype": "float32",
        "enable_lora": True,
        "max_loras": 2,
        "max_lora_rank": 8,
        "lora_paging": "slots",
        "num_kv_blocks": 128,
        "max_num_batched_tokens": 24,  # prompts in chunks, beside other adapters' decodes
    }
    got = {}
    for size in (1, 2):
        with LLM(str(base), tensor_parallel_size=size, **options) as llm:
            outs = llm.generate(
                [p for _ in order for p in prompts],
                GREEDY,
                lora_request=[None if n is None else requests[n] for n in order for _ in prompts],
                use_tqdm=False,
            )
        got[size] = [o.outputs[0].token_ids for o in outs]
    assert got[2] == [t for n in order for t in expected[n]]
    assert got[2] == got[1]
