"""Tiny GPTQ, AWQ and compressed-tensors checkpoints for tests, built from known integers.

:func:`quantized_checkpoint` takes a tiny float32 Llama (:mod:`tests.checkpoints`), rounds each
decoder projection to integer codes with f16 scales (per group of input columns: symmetric, or
with zero points), writes them in the method's own packing (written here from the formats'
descriptions, independently of pagedkv's unpacking) and returns the folder with, per layer, the
dense weight those integers stand for: ``s * (q - z)`` in float32. Its
``quantization_config`` is the one the method's tools write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pagedkv.models.loader import checkpoint_targets
from pagedkv.models.quantized import QuantizedLinear
from tests.checkpoints import make_checkpoint

#: Projections wide enough for groups of 128 input columns, outputs a multiple of 8.
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: AWQ's order of the 8 columns inside an int32: nibble i holds column AWQ_ORDER[i].
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass(frozen=True)
class Variant:
    """One way a checkpoint is quantized and stored."""

    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    #: GPTQ: "gptq" (zero points stored minus one) or "gptq_v2"
    checkpoint_format: str = "gptq"
    desc_act: bool = False
    #: the scales' dtype: f16 as GPTQ and AWQ store them; compressed-tensors often keeps bfloat16
    scale_dtype: str = "float16"


@dataclass(frozen=True)
class Ints:
    codes: torch.Tensor  # int64 [out, in]
    scales: torch.Tensor  # float16 or bfloat16 [out, groups]
    zeros: torch.Tensor  # int64 [out, groups]

    def dense(self, group: int) -> torch.Tensor:
        """``s * (q - z)`` in float32: the weight these integers stand for."""
        s = self.scales.float().repeat_interleave(group, dim=1)
        return s * (self.codes - self.zeros.repeat_interleave(group, dim=1)).float()


def round_to_ints(
    weight: torch.Tensor, bits: int, group: int, symmetric: bool, scale_dtype: torch.dtype = torch.float16
) -> Ints:
    """Round-to-nearest integers of ``weight`` ``[out, in]`` with one scale per group."""
    out, inp = weight.shape
    g = weight.reshape(out, inp // group, group)
    top = 2**bits - 1
    if symmetric:
        middle = 2 ** (bits - 1)
        scales = (g.abs().amax(-1) / (middle - 1)).clamp_min(1e-4).to(scale_dtype)
        zeros = torch.full(scales.shape, middle, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / top).clamp_min(1e-4).to(scale_dtype)
        zeros = (-lo / scales.float()).round().clamp(0, top).long()
    codes = ((g / scales.float()[..., None]).round() + zeros[..., None]).clamp(0, top).long()
    return Ints(codes.reshape(out, inp), scales, zeros)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes ``[..., n * p]`` -> int32 ``[..., n]``, ``p = 32 // bits`` codes per word,
    the first in the lowest bits."""
    p = 32 // bits
    v = values.numpy().astype(np.uint32).reshape(*values.shape[:-1], -1, p)
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i in range(p):
        words |= v[..., i] << np.uint32(bits * i)
    return torch.from_numpy(words.view(np.int32))


def gptq_tensors(ints: Ints, v: Variant) -> dict[str, torch.Tensor]:
    stored_zeros = ints.zeros - (1 if v.checkpoint_format == "gptq" else 0)
    inp = ints.codes.shape[1]
    return {
        "qweight": _pack_rows(ints.codes.T, v.bits),
        "qzeros": pack(stored_zeros.T.contiguous() & (2**v.bits - 1), v.bits),
        "scales": ints.scales.T.contiguous(),
        "g_idx": (torch.arange(inp) // v.group_size).to(torch.int32),
    }


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, cols]`` packed along the rows -> int32 ``[rows / p, cols]``."""
    return pack(values.T.contiguous(), bits).T.contiguous()


def awq_tensors(ints: Ints, v: Variant) -> dict[str, torch.Tensor]:
    def columns(values: torch.Tensor) -> torch.Tensor:  # [rows, cols] -> [rows, cols / 8]
        rows = values.shape[0]
        interleaved = values.reshape(rows, -1, 8)[:, :, AWQ_ORDER].reshape(rows, -1)
        return pack(interleaved.contiguous(), 4)

    return {
        "qweight": columns(ints.codes.T),
        "qzeros": columns(ints.zeros.T),
        "scales": ints.scales.T.contiguous(),
    }


def compressed_tensors(ints: Ints, v: Variant) -> dict[str, torch.Tensor]:
    parts = {
        "weight_packed": pack(ints.codes, v.bits),  # stored unsigned: signed code + 2**(bits-1)
        "weight_scale": ints.scales.contiguous(),
        "weight_shape": torch.tensor(list(ints.codes.shape), dtype=torch.int64),
    }
    if not v.symmetric:
        parts["weight_zero_point"] = _pack_rows(ints.zeros, v.bits)
    return parts


PACKERS = {"gptq": gptq_tensors, "awq": awq_tensors, "compressed-tensors": compressed_tensors}


def quantization_config(v: Variant) -> dict[str, Any]:
    if v.method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": v.bits,
            "group_size": v.group_size,
            "desc_act": v.desc_act,
            "sym": v.symmetric,
            "checkpoint_format": v.checkpoint_format,
            "damp_percent": 0.01,
            "true_sequential": True,
        }
    if v.method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": v.group_size,
            "zero_point": True,
            "version": "gemm",
        }
    weights = {
        "num_bits": v.bits,
        "type": "int",
        "symmetric": v.symmetric,
        "strategy": "group",
        "group_size": v.group_size,
        "dynamic": False,
        "actorder": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def quantized_checkpoint(
    tmp_path: Path, v: Variant, seed: int = 0, **shape: int
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama quantized as ``v`` in ``tmp_path``, and ``{"<layer>.weight": dense weight}``
    of every quantized layer (the integers' own values, float32); ``shape`` overrides
    :data:`SHAPE`'s sizes."""
    folder = make_checkpoint(tmp_path, "llama", seed=seed, **{**SHAPE, **shape})
    tensors = load_file(folder / "model.safetensors")
    dense = {}
    for name in [n for n in tensors if n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))]:
        layer = name.removesuffix(".weight")
        scale_dtype = getattr(torch, v.scale_dtype)
        ints = round_to_ints(tensors.pop(name), v.bits, v.group_size, v.symmetric, scale_dtype)
        dense[name] = ints.dense(v.group_size)
        tensors.update({f"{layer}.{part}": t for part, t in PACKERS[v.method](ints, v).items()})
    save_file(tensors, str(folder / "model.safetensors"))
    set_quantization_config(folder, quantization_config(v))
    return folder, dense


def set_quantization_config(folder: Path, config: dict[str, Any] | None) -> None:
    file = folder / "config.json"
    raw = json.loads(file.read_text())
    raw["quantization_config"] = config
    if config is None:
        del raw["quantization_config"]
    file.write_text(json.dumps(raw, indent=2))


def dense_checkpoint(tmp_path: Path, quantized: Path, weights: dict[str, torch.Tensor]) -> Path:
    """The float32 checkpoint of ``quantized``'s config and unquantized tensors with ``weights``
    in place of its quantized layers: the reference a quantized load must equal."""
    folder = tmp_path / f"{quantized.name}-dense"
    folder.mkdir()
    for file in quantized.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    set_quantization_config(folder, None)
    tensors = load_file(quantized / "model.safetensors")
    layers = {name.removesuffix(".weight") for name in weights}
    kept = {n: t for n, t in tensors.items() if n.rpartition(".")[0] not in layers}
    save_file({**kept, **{n: w.contiguous() for n, w in weights.items()}}, str(folder / "model.safetensors"))
    return folder


#: a packed projection's checkpoint shards, in its row order
_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def dense_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> float32 value of every weight of ``model``: dense parameters as held, a
    :class:`QuantizedLinear`'s blocks dequantized (a packed projection split back into shards)."""
    quantized = {name for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}
    weights = {
        name: tensor.float()
        for name, tensor in checkpoint_targets(model).items()
        if name.rpartition(".")[0] not in quantized  # a quantized layer's bias: with its weight
    }
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        parent, _, attribute = name.rpartition(".")
        dense = module.dense_weight()
        bias = None if module.bias is None else module.bias.detach().float()
        if attribute not in _SHARDS:
            weights[f"{name}.weight"] = dense
            if bias is not None:
                weights[f"{name}.bias"] = bias
            continue
        owner = model.get_submodule(parent)
        sizes = (
            (owner.q_size, owner.kv_size, owner.kv_size)
            if attribute == "qkv_proj"
            else (owner.intermediate_size,) * 2
        )
        for shard, rows in zip(_SHARDS[attribute], dense.split(sizes), strict=True):
            weights[f"{parent}.{shard}.weight"] = rows
        if bias is not None:
            for shard, rows in zip(_SHARDS[attribute], bias.split(sizes), strict=True):
                weights[f"{parent}.{shard}.bias"] = rows
    return weights
