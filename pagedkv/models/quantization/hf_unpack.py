"""Unpack one layer of a GPTQ, AWQ or compressed-tensors checkpoint into integer codes, scales
and zero points (:class:`~pagedkv.models.quantization.blocks.GroupedInts`, rows = output features).

Each format packs ``32 // bits`` codes into an int32, the first in the lowest bits:

- GPTQ: ``qweight`` ``[in / p, out]`` packed along the input; ``qzeros`` ``[groups, out / p]``
  packed along the output, stored as ``z - 1`` in the original format (``checkpoint_format``
  "gptq"; "gptq_v2" stores ``z``); ``scales`` ``[groups, out]``; ``g_idx`` ``[in]``, the group of
  each input column, which act-order (``desc_act``) checkpoints may permute: only the order
  ``k // group_size`` loads, since a GGUF block needs one scale for 32 consecutive columns.
- AWQ (GEMM): ``qweight`` ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]`` packed along the
  output in AWQ's interleaved order (the int32's nibble ``i`` holds column ``8c + [0, 2, 4, 6, 1,
  3, 5, 7][i]``); ``scales`` ``[groups, out]``; zero points stored as they are.
- compressed-tensors ``pack-quantized``: ``weight_packed`` ``[out, in / p]`` packed along the input,
  signed codes stored plus ``2**(bits-1)``; ``weight_scale`` ``[out, groups]``;
  ``weight_zero_point`` ``[out / p, groups]`` packed along the output the same way (asymmetric
  only); ``weight_shape`` ``[out, in]``; ``weight_g_idx`` for its group act-order.

The stored unsigned codes and zero points are used as they are: ``s * (q - z)`` is the same with
both shifted by ``2**(bits-1)``, so a symmetric compressed-tensors weight has zero point 8 (128)
like a symmetric GPTQ one.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.models.quantization.blocks import GroupedInts
from pagedkv.models.quantization.hf_scheme import QuantScheme

#: AWQ's column order inside an int32, inverted: column ``j`` of a pack is nibble ``_AWQ_UNDO[j]``.
_AWQ_UNDO = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def unpack(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> GroupedInts:
    """The integers of layer ``name`` from its tensors ``parts`` (by suffix: ``qweight``, ...)."""
    unpackers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}
    weight = unpackers[scheme.method](scheme, {k: v.cpu() for k, v in parts.items()}, name)
    zeros = weight.zeros
    if weight.scales.shape[0] != weight.codes.shape[0] or (
        zeros is not None and zeros.shape != weight.scales.shape
    ):
        raise ValueError(
            f"{name}: scales {weight.scales.shape} and zero points {None if zeros is None else zeros.shape} "
            f"do not match {weight.codes.shape[0]} output rows (as [rows, groups])"
        )
    groups = weight.scales.shape[1]
    expected = 1 if scheme.group_size is None else weight.codes.shape[1] // scheme.group_size
    if groups != expected or weight.codes.shape[1] % groups:
        raise ValueError(
            f"{name}: {groups} scale groups for {weight.codes.shape[1]} input columns, "
            f"but the config says group_size {scheme.group_size}"
        )
    return weight


def _bits(packed: torch.Tensor, bits: int) -> np.ndarray:
    """int32 ``[..., n]`` -> its codes ``[..., n, 32 // bits]``, the lowest bits first."""
    words = packed.numpy().view(np.uint32)[..., None]
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    return ((words >> shifts) & np.uint32((1 << bits) - 1)).astype(np.uint8)


def _along_rows(packed: torch.Tensor, bits: int) -> np.ndarray:
    """int32 ``[rows / p, cols]`` packed along its rows -> ``[rows, cols]``."""
    codes = _bits(packed, bits)  # [rows / p, cols, p]
    return codes.transpose(0, 2, 1).reshape(-1, packed.shape[1])


def _scales(tensor: torch.Tensor) -> np.ndarray:
    return tensor.to(torch.float32).numpy()


def _gptq(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> GroupedInts:
    codes = _along_rows(parts["qweight"], scheme.bits).T  # [out, in]
    zeros = _bits(parts["qzeros"], scheme.bits).reshape(parts["qzeros"].shape[0], -1)
    scales = _scales(parts["scales"]).T
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        _check_in_order(g_idx, codes.shape[1] // scales.shape[1], name)
    return GroupedInts(
        np.ascontiguousarray(codes), scales, zeros.T.astype(np.int16) + scheme.zero_offset, scheme.bits
    )


def _awq(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> GroupedInts:
    def columns(packed: torch.Tensor) -> np.ndarray:
        return _bits(packed, 4)[:, :, _AWQ_UNDO].reshape(packed.shape[0], -1)

    codes, zeros = columns(parts["qweight"]), columns(parts["qzeros"])
    return GroupedInts(np.ascontiguousarray(codes.T), _scales(parts["scales"]).T, zeros.T.astype(np.int16), 4)


def _compressed(scheme: QuantScheme, parts: dict[str, torch.Tensor], name: str) -> GroupedInts:
    packed = parts["weight_packed"]
    codes = _bits(packed, scheme.bits).reshape(packed.shape[0], -1)
    shape = parts.get("weight_shape")
    if shape is not None:
        out, inp = (int(v) for v in shape.tolist())
        if out != codes.shape[0] or inp > codes.shape[1]:
            raise ValueError(
                f"{name}: weight_shape {[out, inp]} does not fit weight_packed {tuple(packed.shape)}"
            )
        codes = codes[:, :inp]
    scales = _scales(parts["weight_scale"])
    if "weight_g_idx" in parts:
        _check_in_order(parts["weight_g_idx"], codes.shape[1] // scales.shape[1], name)
    zeros = None
    if not scheme.symmetric:
        zeros = _along_rows(parts["weight_zero_point"], scheme.bits)[: codes.shape[0]].astype(np.int16)
    elif "weight_zero_point" in parts and parts["weight_zero_point"].any():
        raise ValueError(f"{name}: the checkpoint is symmetric, but its weight_zero_point is not zero")
    return GroupedInts(np.ascontiguousarray(codes), scales, zeros, scheme.bits)


def _check_in_order(g_idx: torch.Tensor, group_size: int, name: str) -> None:
    """Refuse an act-order permutation: column ``k`` must be in group ``k // group_size``."""
    in_order = torch.arange(g_idx.numel()) // group_size
    if not torch.equal(g_idx.to(torch.int64).flatten(), in_order):
        raise ValueError(
            f"{name}: act-order (desc_act) g_idx that permutes the input columns is not supported; "
            f"supported: g_idx equal to k // group_size (columns in order)"
        )
