"""The shipped draft model: the built-in model's recipe at a smaller shape, with its tokenizer,
several times smaller, and agreeing with it often enough to be worth proposing tokens."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import transformers
from safetensors import safe_open

from pagedkv import LLM, SamplingParams
from pagedkv.models import ModelConfig, builtin_model_path, shipped_model_path
from pagedkv.models.builtin.train import stdlib_text
from pagedkv.models.builtin.train.draft import DRAFT_MODEL, DRAFT_MODEL_DIR, DRAFT_RECIPE

WINDOW = 256


def parameters(folder) -> int:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def test_the_folder_is_the_draft_recipe_with_the_built_in_tokenizer():
    assert shipped_model_path(DRAFT_MODEL) == DRAFT_MODEL_DIR
    manifest = json.loads((DRAFT_MODEL_DIR / "training.json").read_text())
    assert manifest["recipe"] == dataclasses.asdict(DRAFT_RECIPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (DRAFT_MODEL_DIR / name).read_bytes() == (builtin_model_path() / name).read_bytes()
    cfg = ModelConfig.from_pretrained(DRAFT_MODEL_DIR)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == (64, 2, 1)
    assert cfg.vocab_size == ModelConfig.from_pretrained(builtin_model_path()).vocab_size
    assert (DRAFT_MODEL_DIR / "model.safetensors").stat().st_size < 2**19
    assert 4 <= parameters(builtin_model_path()) / parameters(DRAFT_MODEL_DIR) <= 8


@pytest.fixture(scope="module")
def heldout_window():
    """The first ``WINDOW`` tokens of the first long enough held-out file (never trained on)."""
    _, heldout = stdlib_text.split_files()
    tokenizer = transformers.AutoTokenizer.from_pretrained(builtin_model_path())
    for text in stdlib_text.read_sources(heldout):
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= WINDOW:
            return ids[:WINDOW]
    raise AssertionError("no held-out file is long enough")


def test_the_draft_predicts_the_built_in_models_next_token_often(heldout_window):
    """Teacher-forced over held-out Python: how often both models' argmax agree (chance: 1 in
    2048)."""
    ids = torch.tensor([heldout_window])
    argmax = []
    for folder in (builtin_model_path(), DRAFT_MODEL_DIR):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            argmax.append(model(ids).logits[0].argmax(dim=-1))
    agreement = (argmax[0] == argmax[1]).double().mean().item()
    assert agreement > 0.4


def test_pagedkv_runs_the_draft():
    llm = LLM(str(DRAFT_MODEL_DIR), dtype="float32", num_kv_blocks=32, block_size=16)
    out = llm.generate("def main(", SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert 1 <= len(out[0].outputs[0].token_ids) <= 16
