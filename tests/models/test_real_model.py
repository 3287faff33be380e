"""The real pretrained model (SmolLM2-135M-Instruct, dequantized from its GGUF) runs exactly:
greedy float32 tokens equal transformers' on chat prompts."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from tests.real_model import ENGINE_OPTIONS

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]


@pytest.fixture(scope="module")
def llm(real_model):
    # the default ("auto") pool: these limits keep it to what 4 short chats can use
    with LLM(str(real_model), **ENGINE_OPTIONS) as engine:
        yield engine


def test_greedy_chat_tokens_equal_transformers(llm, real_model):
    import torch
    import transformers

    prompts = [llm.tokenizer.apply_chat_template(c, True, False) for c in CONVERSATIONS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([output.prompt_token_ids])
        expected = reference.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        got = list(output.outputs[0].token_ids)
        assert got == expected[: len(got)], prompt
        assert len(got) == len(expected) or output.outputs[0].finish_reason == "stop"
    assert "Paris" in outputs[0].outputs[0].text
