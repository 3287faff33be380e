"""The shipped built-in model: a small, complete Hugging Face folder that pagedkv and transformers
both read and agree on, whose tokenizer round-trips source it never saw, and which has learned
Python (held-out perplexity far below chance, printable code out)."""

from __future__ import annotations

import json
import string

import pytest
import torch
import transformers
from safetensors import safe_open

from pagedkv import LLM, SamplingParams
from pagedkv.models import BUILTIN_NOTE, ModelConfig, builtin_model_path, load_model
from pagedkv.models.builtin.train import stdlib_text
from pagedkv.models.builtin.train.windows import document_windows, encode_documents, perplexity, scored_tokens
from pagedkv.tokenizer import load_tokenizer

from ..paging import PagedBatch

#: The repository check warns above this size for any tracked file.
MAX_FILE_BYTES = 2 * 2**20
PROMPT_TOKENS = 40


@pytest.fixture(scope="module")
def path():
    return builtin_model_path()


@pytest.fixture(scope="module")
def manifest(path):
    return json.loads((path / "training.json").read_text())


@pytest.fixture(scope="module")
def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )


@pytest.fixture(scope="module")
def heldout_texts():
    """The first held-out source files of this Python (never trained on, by the split rule)."""
    _, heldout = stdlib_text.split_files()
    return stdlib_text.read_sources(heldout[:6])


@pytest.fixture(scope="module")
def heldout_prompts(path, heldout_texts):
    """The first tokens of each held-out file, BOS first, as the engine would encode them."""
    tok = load_tokenizer(path)
    return [tok.encode(text)[:PROMPT_TOKENS] for text in heldout_texts[:3]]


def test_folder_is_complete_small_and_described(path, manifest):
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training.json",
    } <= names
    assert all(p.stat().st_size < MAX_FILE_BYTES for p in path.iterdir())
    cfg = ModelConfig.from_pretrained(path)
    recipe = manifest["recipe"]
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM",
        recipe["hidden_size"],
        recipe["num_layers"],
        recipe["num_heads"],
        recipe["num_kv_heads"],
    )
    assert cfg.vocab_size == load_tokenizer(path).vocab_size == recipe["vocab_size"]
    assert f"{cfg.num_layers} layers, hidden {cfg.hidden_size}" in BUILTIN_NOTE
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert {str(f.get_slice(name).get_dtype()) for name in f.keys()} == {"BF16"}
    # every held-out file the model was measured on is held out by the rule, so never trained on
    assert all(stdlib_text.is_held_out(f) for f in manifest["text"]["heldout_files"])


def test_prompt_logits_agree_with_transformers(path, hf_model, heldout_prompts):
    ours = load_model(path, dtype=torch.float32, attention_backend="torch")
    got = PagedBatch(ours, max_len=PROMPT_TOKENS, num_seqs=len(heldout_prompts), block_size=16).step(
        heldout_prompts
    )
    for ids, logits in zip(heldout_prompts, got, strict=True):
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0]
        assert (logits - want).abs().max().item() < 1e-4


def test_greedy_tokens_equal_transformers(hf_model, heldout_prompts):
    """EOS is honoured on both sides: a trained model may well end a file."""
    llm = LLM(dtype="float32", num_kv_blocks=64, block_size=16)
    outs = llm.generate(heldout_prompts, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    for prompt, out in zip(heldout_prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=1
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == want


def test_tokenizer_round_trips_heldout_source(path, heldout_texts):
    ours = load_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for text in heldout_texts:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ours.decode(ids) == text
        assert len(ids) < len(text) / 2  # merges learned from Python source compress unseen Python


def test_heldout_perplexity_is_far_below_chance(path, hf_model, heldout_texts, manifest):
    """Chance is the vocabulary size (2048); token frequencies alone (a unigram model of the
    training text) score ~590 on the held-out files; only context brings it under 100."""
    tok = load_tokenizer(path).backend
    windows = document_windows(encode_documents(tok, heldout_texts[:2]), manifest["recipe"]["context"])
    nll = 0.0
    with torch.no_grad():
        for window in windows:
            logits = hf_model(torch.tensor([window])).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum").item()
    assert perplexity(nll, scored_tokens(windows)) < 100


def test_generates_printable_python(path):
    llm = LLM(dtype="float32", num_kv_blocks=64, block_size=16)
    prompt = 'import os\n\n\nclass Cache:\n    """A cache of files."""\n\n    def __init__(self, path):\n'
    params = SamplingParams(max_tokens=64, temperature=0.0)
    text = llm.generate([prompt + "        self."], params, use_tqdm=False)[0].outputs[0].text
    assert len(text) > 40
    printable = sum(c in string.printable for c in text)
    assert printable / len(text) > 0.95
    assert "self" in text  # a method body refers to its instance
