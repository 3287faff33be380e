"""load_model: single and sharded safetensors, tied heads, dtype/device, and every way a
folder can disagree with its config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.models import load_model
from pagedkv.models.loader import weight_files
from tests.checkpoints import make_checkpoint


def test_sharded_and_single_file_load_the_same_weights(tmp_path):
    single = make_checkpoint(tmp_path, "qwen2")
    sharded = make_checkpoint(tmp_path, "qwen2", max_shard_size="40KB")
    files = weight_files(sharded)
    assert len(files) > 2 and all(f.parent == sharded for f in files)
    a = load_model(single).state_dict()
    b = load_model(sharded).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_weights_equal_the_files_and_model_is_frozen(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3")
    tensors = load_file(path / "model.safetensors")
    model = load_model(path, dtype="bfloat16")
    assert not model.training
    params = dict(model.named_parameters())
    assert params.keys() == tensors.keys()  # HF names are our names, nothing extra, nothing missing
    for name, tensor in tensors.items():
        assert params[name].dtype == torch.bfloat16 and not params[name].requires_grad
        assert torch.equal(params[name], tensor.to(torch.bfloat16))


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
