"""``load_format="dummy"``: a model of a config's shape with seeded random weights drawn by name,
no checkpoint read -- the same weights in pagedkv's packed layout and in transformers' own."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedkv.models import load_model
from pagedkv.models.dummy_weights import STD, dummy_tensor, fill_dummy_weights
from tests.checkpoints import hf_config

from .paging import PagedBatch


def _config_only(tmp_path, **overrides):
    """A folder holding only config.json (what a benchmark of a model's shape writes)."""
    config = hf_config("llama", **overrides)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return tmp_path, config


def test_a_name_always_draws_the_same_tensor_and_two_names_differ():
    a = dummy_tensor("model.layers.0.self_attn.q_proj.weight", (64, 32), torch.float32, "cpu")
    again = dummy_tensor("model.layers.0.self_attn.q_proj.weight", (64, 32), torch.float32, "cpu")
    other = dummy_tensor("model.layers.1.self_attn.q_proj.weight", (64, 32), torch.float32, "cpu")
    assert torch.equal(a, again) and not torch.equal(a, other)
    assert abs(a.std().item() - STD) < 0.003
    assert torch.equal(dummy_tensor("model.norm.weight", (8,), torch.float32, "cpu"), torch.ones(8))
    assert torch.equal(
        dummy_tensor("model.layers.0.mlp.down_proj.bias", (8,), torch.float32, "cpu"), torch.zeros(8)
    )


@pytest.mark.parametrize("tied", [False, True])
def test_a_dummy_model_computes_the_logits_of_transformers_given_the_same_named_weights(tmp_path, tied):
    """pagedkv fills its packed projections' row slices by checkpoint name; transformers' model,
    filled by the same names, is the same network."""
    folder, config = _config_only(tmp_path, tie_word_embeddings=tied)
    ours = load_model(folder, "float32", load_format="dummy")
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    fill_dummy_weights(dict(hf.named_parameters()))
    prompt = [5, 9, 17, 3, 250, 11, 42]
    got = PagedBatch(ours, 16, 1).step([prompt])[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    assert (got - want).abs().max().item() < 1e-5


def test_an_unknown_load_format_is_refused(tmp_path):
    folder, _ = _config_only(tmp_path)
    with pytest.raises(ValueError, match="unknown load_format 'npz'"):
        load_model(folder, "float32", load_format="npz")
