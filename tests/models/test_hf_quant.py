"""GPTQ, AWQ and compressed-tensors checkpoints load through the real loader as GGUF blocks: the
dense weight equals the checkpoint's float32 dequantization (exactly for symmetric ones, within
half an f16 ulp of ``s * z`` with zero points), greedy tokens equal the dequantized model's, and
every method or option that does not load is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv import LLM, SamplingParams
from pagedkv.models import load_model
from tests.quant_checkpoints import (
    AWQ_ORDER,
    Variant,
    dense_checkpoint,
    dense_weights,
    quantized_checkpoint,
    set_quantization_config,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["def add(a, b):", "hello world", "the quick brown fox"]

VARIANTS = {
    "gptq-sym": Variant("gptq"),
    "gptq-zero-point": Variant("gptq", symmetric=False),
    "gptq-sym-act-order": Variant("gptq", desc_act=True),
    "gptq-v2-zero-point": Variant("gptq", symmetric=False, checkpoint_format="gptq_v2"),
    "gptq-8bit": Variant("gptq", bits=8),
    "gptq-group-64": Variant("gptq", group_size=64, symmetric=False),
    "awq": Variant("awq", symmetric=False),
    "ct-w4a16": Variant("compressed-tensors"),
    "ct-w4a16-bf16-scales": Variant("compressed-tensors", scale_dtype="bfloat16"),
    "ct-w4a16-asym": Variant("compressed-tensors", symmetric=False),
    "ct-w8a16": Variant("compressed-tensors", bits=8),
}


# -- the checkpoints' own dequantization, in torch, as vLLM / transformers / compressed-tensors write it
def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> codes, ``32 // bits`` per word along ``dim``, the lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:  # [rows / p, cols] -> [rows, cols]
        codes = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & (2**bits - 1)
        return codes.reshape(-1, words.shape[1]).long()
    codes = (words.unsqueeze(2) >> shifts.view(1, 1, -1)) & (2**bits - 1)
    return codes.reshape(words.shape[0], -1).long()


def reference_dense(v: Variant, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight ``[out, in]`` of one layer's packed tensors."""
    if v.method == "gptq":  # vLLM's GPTQ torch path: scales[g_idx] * (weight - zeros[g_idx])
        weight = _unpack(parts["qweight"], v.bits, 0)  # [in, out]
        zeros = _unpack(parts["qzeros"], v.bits, 1) + (1 if v.checkpoint_format == "gptq" else 0)
        g_idx = parts["g_idx"].long()
        return (parts["scales"].float()[g_idx] * (weight - zeros[g_idx]).float()).T
    if v.method == "awq":  # AutoAWQ's dequantize_gemm: unpack, undo the order, (q - z) * s
        undo = torch.tensor(np.argsort(AWQ_ORDER))
        weight = _unpack(parts["qweight"], 4, 1).reshape(-1, parts["qweight"].shape[1], 8)[:, :, undo]
        zeros = _unpack(parts["qzeros"], 4, 1).reshape(-1, parts["qzeros"].shape[1], 8)[:, :, undo]
        weight, zeros = weight.reshape(weight.shape[0], -1), zeros.reshape(zeros.shape[0], -1)
        group = weight.shape[0] // zeros.shape[0]
        scales = parts["scales"].float().repeat_interleave(group, 0)
        return ((weight - zeros.repeat_interleave(group, 0)).float() * scales).T
    # compressed-tensors unpack_from_int32 + dequantize: (q - z) * s with signed q and z
    offset = 2 ** (v.bits - 1)
    weight = _unpack(parts["weight_packed"], v.bits, 1) - offset
    zeros = torch.zeros_like(parts["weight_scale"], dtype=torch.long)
    if "weight_zero_point" in parts:
        zeros = _unpack(parts["weight_zero_point"], v.bits, 0) - offset
    group = weight.shape[1] // zeros.shape[1]
    scales = parts["weight_scale"].float().repeat_interleave(group, 1)
    return (weight - zeros.repeat_interleave(group, 1)).float() * scales


def _layer_parts(folder, layer: str) -> dict[str, torch.Tensor]:
    tensors = load_file(folder / "model.safetensors")
    return {n.rpartition(".")[2]: t for n, t in tensors.items() if n.rpartition(".")[0] == layer}


def _greedy(folder, **options) -> list[list[int]]:
    with LLM(str(folder), dtype="float32", num_kv_blocks=64, **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("key", VARIANTS)
def test_dense_weights_equal_the_checkpoints_dequantization(tmp_path, key):
    v = VARIANTS[key]
    folder, known = quantized_checkpoint(tmp_path, v)
    model = load_model(folder, dtype="float32", linear_kernel="torch")
    assert model.quantization.startswith(f"{v.method} int{v.bits}")
    targets = dense_weights(model)
    asymmetric_error = 0.0
    for name, want in known.items():
        layer = name.removesuffix(".weight")
        parts = _layer_parts(folder, layer)
        reference = reference_dense(v, parts)
        assert torch.equal(reference, want)  # the test's packing is the format's
        got = targets[name]
        if v.symmetric:  # Q4_0 / Q8_0 with d = s: exact
            assert torch.equal(got, reference), name
            continue
        # Q4_1: m = f16(-s * z), within half an f16 ulp of s * z, exact where s * z is an f16
        s, z = _scales_and_zeros(v, parts, reference.shape)
        bound = torch.where((s * z).half().float() == s * z, 0.0, 2.0**-11 * (s * z).abs())
        assert torch.all((got - reference).abs() <= bound), name
        asymmetric_error = max(asymmetric_error, ((got - reference).abs() / s).max().item())
    assert asymmetric_error <= 15 * 2.0**-11  # under 1 % of a quantization step


def _scales_and_zeros(v: Variant, parts, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Per weight: the scale and the zero point of its group, ``[out, in]`` float32."""
    inp = shape[1]
    if v.method == "compressed-tensors":
        s = parts["weight_scale"].float()
        z = _unpack(parts["weight_zero_point"], v.bits, 0).float()  # of the unsigned codes Q4_1 holds
    else:
        s = parts["scales"].float().T
        if v.method == "gptq":
            z = _unpack(parts["qzeros"], v.bits, 1).T.float() + (v.checkpoint_format == "gptq")
        else:
            undo = torch.tensor(np.argsort(AWQ_ORDER))
            z = _unpack(parts["qzeros"], 4, 1).reshape(-1, parts["qzeros"].shape[1], 8)[:, :, undo]
            z = z.reshape(z.shape[0], -1).T.float()
    group = inp // s.shape[1]
    return s.repeat_interleave(group, 1), z.repeat_interleave(group, 1)


@pytest.mark.parametrize("key", ["gptq-sym", "gptq-zero-point", "awq", "ct-w4a16", "ct-w8a16"])
def test_greedy_tokens_equal_the_dequantized_models(tmp_path, key):
    v = VARIANTS[key]
    folder, known = quantized_checkpoint(tmp_path, v)
    weights = {name: reference_dense(v, _layer_parts(folder, name.removesuffix(".weight"))) for name in known}
    assert _greedy(folder) == _greedy(dense_checkpoint(tmp_path, folder, weights))


def test_quantize_config_json_is_read_and_gptq_zero_biases_are_dropped(tmp_path):
    """AutoGPTQ writes its config beside config.json, and an all-zero bias for every layer."""
    folder, known = quantized_checkpoint(tmp_path, VARIANTS["gptq-sym"])
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    set_quantization_config(folder, None)
    (folder / "quantize_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "quant_method"})
    )
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128)
    save_file(tensors, str(folder / "model.safetensors"))
    targets = dense_weights(load_model(folder, dtype="float32", linear_kernel="torch"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(targets[name], known[name])
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(128)  # not a placeholder: refused
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.bias: the model has no bias on this layer"):
        load_model(folder, dtype="float32")


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "hqq", "nbits": 4}, "'hqq'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": False}, "8 bits and zero points"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size 100"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point=false"),
    ],
)
def test_a_method_or_option_that_does_not_load_is_named(tmp_path, config, named):
    folder, _ = quantized_checkpoint(tmp_path, VARIANTS["gptq-sym"])
    set_quantization_config(folder, config)
    with pytest.raises(ValueError, match="pagedkv loads gptq") as caught:
        load_model(folder)
    assert named in str(caught.value) and "does not use" not in str(caught.value)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"input_activations": {"num_bits": 8, "type": "int"}}, "quantized activations"),
        ({"format": "float-quantized"}, "'float-quantized'"),
        ({"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}, "float weights"),
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}, "strategy 'tensor'"),
    ],
)
def test_compressed_tensors_schemes_that_do_not_load_are_named(tmp_path, change, named):
    folder, _ = quantized_checkpoint(tmp_path, VARIANTS["ct-w4a16"])
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"].update(change)
    set_quantization_config(folder, config)
    with pytest.raises(ValueError, match="compressed-tensors checkpoint with") as caught:
        load_model(folder)
    assert named in str(caught.value)


def test_act_order_that_permutes_columns_is_refused(tmp_path):
    folder, _ = quantized_checkpoint(tmp_path, VARIANTS["gptq-sym-act-order"])
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="act-order") as caught:
        load_model(folder)
    assert "model.layers.1.mlp.down_proj" in str(caught.value)


def test_a_quantized_checkpoint_refuses_on_the_fly_quantization(tmp_path):
    folder, _ = quantized_checkpoint(tmp_path, VARIANTS["awq"])
    with pytest.raises(ValueError, match="already quantized \\(awq\\)"):
        load_model(folder, quantization="q8_0")


def test_a_layer_missing_a_part_is_named(tmp_path):
    folder, _ = quantized_checkpoint(tmp_path, VARIANTS["gptq-zero-point"])
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.qzeros"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj lacks \\['qzeros'\\]"):
        load_model(folder)


def test_parts_that_disagree_on_the_shape_are_named(tmp_path):
    folder, _ = quantized_checkpoint(tmp_path, VARIANTS["awq"])
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.qzeros"
    tensors[name] = tensors[name][:, :-1].contiguous()  # 8 output columns short
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.o_proj: scales .* do not match"):
        load_model(folder)
