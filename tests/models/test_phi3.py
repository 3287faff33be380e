"""Phi-3 (``Phi3ForCausalLM``) against transformers, in float32.

Its checkpoints store ``qkv_proj`` and ``gate_up_proj`` fused; the loader reads each as its
parts (:mod:`pagedkv.models.fused_weights`) into the same packed projections a split Llama
checkpoint fills. Exact through the packed forward (torch and C backends) and ``LLM`` (block
sizes 1 and 16, chunked prefill, prefix cache), with plain RoPE, a sliding window and the
128k models' longrope (its long factors: every prompt is longer than the pretraining length).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedkv import LLM
from pagedkv.models import load_model
from pagedkv.models.config import ModelConfig
from pagedkv.models.rope import rotary_row_order
from tests.checkpoints import make_checkpoint

from .hf_reference import assert_greedy_tokens_match, assert_packed_logits_match, hf_model

LONGROPE = {
    "max_position_embeddings": 64,
    "original_max_position_embeddings": 16,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 100.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.0 + 1.5 * i for i in range(8)],
    },
}
#: Phi-4-mini's shape: longrope over the first three quarters of each head (12 of 16)
PARTIAL = {
    **LONGROPE,
    "rope_parameters": {
        **LONGROPE["rope_parameters"],
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [1.0 + 1.5 * i for i in range(6)],
    },
}
CASES = {
    "phi3": {"max_position_embeddings": 64},
    "phi3-sliding": {"max_position_embeddings": 64, "sliding_window": 12},
    "phi3-longrope": LONGROPE,
    "phi4-mini-partial-rotary": PARTIAL,
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    refs = {}
    for name, overrides in CASES.items():
        path = make_checkpoint(tmp_path_factory.mktemp(name), "phi3", **overrides)
        refs[name] = (path, hf_model(path))
    return refs


def test_the_checkpoint_stores_fused_projections(references):
    path, _ = references["phi3"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in n or "gate_proj" in n for n in names)


def test_the_config_reads_phi3_as_transformers_does(references):
    cfg = ModelConfig.from_pretrained(references["phi3-longrope"][0])
    assert cfg.architecture == "Phi3ForCausalLM"
    assert cfg.rope.type == "longrope"
    assert cfg.rope.params["original_max_position_embeddings"] == 16
    assert cfg.rope.params["factor"] == 4.0  # context over pretraining length
    sliding = ModelConfig.from_pretrained(references["phi3-sliding"][0])
    assert sliding.layer_types == ("sliding_attention",) * sliding.num_layers


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_prefill_and_decode_logits_match_transformers(references, case, backend):
    assert_packed_logits_match(*references[case], backend)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_tokens_equal_transformers(references, case, block_size):
    assert_greedy_tokens_match(*references[case], block_size)


def _rewrite(path, change) -> None:
    """Rewrite ``path``'s weights as ``change(name, tensor)`` -> {name: tensor} says."""
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_file({k: v for n, t in tensors.items() for k, v in change(n, t).items()}, str(file))


def test_split_and_fused_checkpoints_load_the_same_weights(references, tmp_path):
    path, _ = references["phi3"]
    fused = load_model(path, attention_backend="torch")
    split = tmp_path / "split"
    split.mkdir()
    for item in path.iterdir():
        (split / item.name).write_bytes(item.read_bytes())

    def unfuse(name, tensor):
        if name.endswith("qkv_proj.weight"):
            q, k, v = tensor.split((64, 32, 32))  # 4 heads, 2 KV heads of 16
            stem = name.removesuffix("qkv_proj.weight")
            return {f"{stem}q_proj.weight": q, f"{stem}k_proj.weight": k, f"{stem}v_proj.weight": v}
        if name.endswith("gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            stem = name.removesuffix("gate_up_proj.weight")
            return {f"{stem}gate_proj.weight": gate, f"{stem}up_proj.weight": up}
        return {name: tensor}

    _rewrite(split, unfuse)
    loaded = load_model(split, attention_backend="torch")
    for (name, a), (_, b) in zip(fused.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_fused_weight_of_the_wrong_size_is_named(references, tmp_path):
    path = make_checkpoint(tmp_path, "phi3", max_position_embeddings=64)
    _rewrite(path, lambda n, t: {n: t[:-16] if n == "model.layers.1.self_attn.qkv_proj.weight" else t})
    with pytest.raises(
        ValueError, match=r"fused weight model\.layers\.1\.self_attn\.qkv_proj\.weight has 112 rows"
    ):
        load_model(path, attention_backend="torch")


def test_partial_rotary_reorders_query_and_key_rows_only(references):
    path, hf = references["phi4-mini-partial-rotary"]
    model = load_model(path, attention_backend="torch", linear_kernel="torch")  # weights as loaded
    assert model.config.rotary_dim == 12
    assert rotary_row_order(16, 12).tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    ours = model.model.layers[0].self_attn.qkv_proj.weight
    theirs = hf.model.layers[0].self_attn.qkv_proj.weight
    q_head = theirs[16:32]  # the second query head
    assert torch.equal(ours[16:32], q_head[rotary_row_order(16, 12)])
    assert torch.equal(ours[96:], theirs[96:])  # values keep their order


def test_an_odd_rotary_width_is_refused_naming_the_option(tmp_path):
    path = make_checkpoint(tmp_path, "phi3", max_position_embeddings=64)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"]["partial_rotary_factor"] = 0.5625  # 9 of 16
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="partial_rotary_factor gives 9 rotary dimensions of 16"):
        LLM(str(path))
