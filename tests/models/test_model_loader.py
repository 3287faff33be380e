"""load_model: single and sharded safetensors, tied heads, dtype/device, and every way a
folder can disagree with its config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.models import load_model
from pagedkv.models.loader import checkpoint_targets, weight_files
from tests.checkpoints import make_checkpoint


def test_sharded_and_single_file_load_the_same_weights(tmp_path):
    single = make_checkpoint(tmp_path, "qwen2")
    sharded = make_checkpoint(tmp_path, "qwen2", max_shard_size="40KB")
    files = weight_files(sharded)
    assert len(files) > 2 and all(f.parent == sharded for f in files)
    # plain F.linear weights: this is about the files, not the kernel (tests/models/test_linear.py)
    a = load_model(single, linear_kernel="torch").state_dict()
    b = load_model(sharded, linear_kernel="torch").state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_weights_equal_the_files_and_model_is_frozen(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3")
    tensors = load_file(path / "model.safetensors")
    model = load_model(path, dtype="bfloat16", linear_kernel="torch")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    targets = checkpoint_targets(model)
    assert targets.keys() == tensors.keys()  # every HF name has one target, nothing extra
    for name, tensor in tensors.items():
        assert targets[name].dtype == torch.bfloat16
        assert torch.equal(targets[name], tensor.to(torch.bfloat16))


def test_packed_projections_hold_the_shards_in_order(tmp_path):
    """q|k|v rows (and biases) in qkv_proj, gate|up rows in gate_up_proj, nothing else packed."""
    path = make_checkpoint(tmp_path, "qwen2")  # q/k/v biases
    tensors = load_file(path / "model.safetensors")
    model = load_model(path, linear_kernel="torch")
    p = "model.layers.1."
    for kind in ("weight", "bias"):
        want = torch.cat([tensors[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv"])
        assert torch.equal(getattr(model.model.layers[1].self_attn.qkv_proj, kind), want)
    want = torch.cat([tensors[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, want)
    names = {name for name, _ in model.named_parameters()}
    assert f"{p}self_attn.qkv_proj.bias" in names and f"{p}self_attn.q_proj.weight" not in names


def test_tied_embeddings_share_one_tensor(tmp_path):
    path = make_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dtype_defaults_to_the_checkpoint_dtype(tmp_path):
    path = make_checkpoint(tmp_path, "mistral", dtype="bfloat16")
    assert load_model(path).lm_head.weight.dtype == torch.bfloat16
    as_fp32 = load_model(path, dtype=torch.float32)
    assert as_fp32.lm_head.weight.dtype == torch.float32
    assert as_fp32.config.dtype == torch.float32 and as_fp32.config.kv_spec().dtype == "float32"
    with pytest.raises(ValueError, match="float64"):
        load_model(path, dtype="float64")


def _rewrite(path, fn) -> None:
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_weight_is_named(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_missing_packed_shard_is_named_by_its_checkpoint_name(tmp_path):
    path = make_checkpoint(tmp_path, "qwen2")

    def drop(tensors: dict) -> None:
        del tensors["model.layers.0.self_attn.q_proj.weight"], tensors["model.layers.1.self_attn.v_proj.bias"]

    _rewrite(path, drop)
    with pytest.raises(
        ValueError,
        match=r"lacks 2 weights.*layers\.0\.self_attn\.q_proj\.weight.*layers\.1\.self_attn\.v_proj\.bias",
    ):
        load_model(path)


def test_unexpected_weight_is_named(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ValueError, match=r"q_norm\.weight"):
        load_model(path)


def test_shape_mismatch_is_named(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.*has shape.*implies"):
        load_model(path)


def test_packed_shard_shape_mismatch_is_named(tmp_path):
    """Four KV heads in config.json, two in the weights: k_proj's rows of qkv_proj are too many."""
    path = make_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "num_key_value_heads": 4}))
    with pytest.raises(
        ValueError,
        match=r"weight \S+\.self_attn\.[kv]_proj\.weight .* shape \(32, 64\), .* implies \(64, 64\)",
    ):
        load_model(path)


def test_index_naming_a_missing_shard(tmp_path):
    path = make_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    victim = sorted(path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(path)


def test_folder_without_weights(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path)


def test_unsupported_architecture_from_folder(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"GemmaForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(path)
