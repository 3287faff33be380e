"""GGUF blocks from integer weights with per-group scales and zero points.

A GPTQ, AWQ or compressed-tensors weight is, once unpacked, ``w[n, k] = s[n, g] * (q[n, k] - z[n, g])``
with ``g = k // group_size``: unsigned integer codes ``q`` of ``bits`` bits, a float scale ``s``
and an integer zero point ``z`` per group of input columns. GGUF blocks hold 32 consecutive input
columns of one row with one f16 scale, so a group of 32, 64, 128, ... columns is one or more
blocks with the same scale, and the block's codes are the checkpoint's codes unchanged:

- symmetric 4-bit (``z == 8``) -> Q4_0, ``w = d * (q - 8)`` with ``d = s``: exact;
- 4-bit with zero points -> Q4_1, ``w = d * q + m`` with ``d = s`` and ``m = f16(-s * z)``: ``s * z``
  is exact in float32 and rounded once to f16, so the weight is within half an f16 ulp of
  ``|s * z|`` (at most ``2**-11 * 15 * s``, under 1 % of one quantization step) of the checkpoint's
  value, and exact wherever ``s * z`` is an f16 (``z`` a power of two, ...). That is the rounding
  the checkpoints' own fp16 kernels make once per weight (``s * (q - z)`` or ``q * s - z * s``
  rounded to f16), so no exact format is worth the larger Q5_0 blocks;
- symmetric 8-bit (``z == 128``) -> Q8_0, ``w = d * (q - 128)`` with ``d = s``: exact.

Scales stored in f16 are taken as they are; bfloat16 scales are exact in f16 inside its normal
range, float32 scales are rounded to f16 once (relative error at most ``2**-11``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

#: Weights per block of the non-K GGUF types (Q4_0, Q4_1, Q5_0, Q8_0).
BLOCK = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix as GGUF blocks: ``raw[n]`` holds row ``n``'s blocks back to back, as a
    GGUF file stores the tensor of ggml shape ``(in, out)``."""

    raw: np.ndarray  # uint8 [out, in // block_size * type_size]
    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # (out, in)

    def __post_init__(self) -> None:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        out, inp = self.shape
        if inp % block_size:
            raise ValueError(f"{self.qtype.name} rows hold multiples of {block_size} weights, not {inp}")
        want = (out, inp // block_size * type_size)
        if self.raw.dtype != np.uint8 or self.raw.shape != want:
            raise ValueError(f"{self.qtype.name} blocks of a {self.shape} weight are uint8 {want}")


@dataclass(frozen=True)
class GroupedInts:
    """An unpacked checkpoint weight: ``w = scales[:, g] * (codes - zeros[:, g])`` per group ``g``
    of ``group_size`` input columns. ``zeros`` None: symmetric, the middle code ``2**(bits-1)``."""

    codes: np.ndarray  # uint8 [out, in], 0 .. 2**bits - 1
    scales: np.ndarray  # float [out, in // group_size]
    zeros: np.ndarray | None  # int [out, in // group_size]
    bits: int

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]


def to_gguf_blocks(weight: GroupedInts, symmetric: bool, name: str) -> QuantizedWeight:
    """``weight`` as Q4_0 / Q8_0 (``symmetric``: every zero point must be the middle code) or
    Q4_1 (4-bit with zero points); see the module's docstring for what is exact."""
    out, inp = weight.codes.shape
    group = weight.group_size
    if group % BLOCK or inp % group:
        raise ValueError(
            f"{name}: group size {group} does not split into GGUF blocks of {BLOCK} weights; "
            f"supported: group sizes that are multiples of {BLOCK}"
        )
    middle = 1 << (weight.bits - 1)
    zeros = weight.zeros
    if symmetric and zeros is not None:
        if not np.all(zeros == middle):
            raise ValueError(f"{name}: the checkpoint is symmetric, but its zero points are not all {middle}")
        zeros = None
    repeat = group // BLOCK
    scales = np.repeat(weight.scales.astype(np.float32), repeat, axis=1)
    d = scales.astype(np.float16)
    if weight.bits == 8:
        if zeros is not None:
            raise ValueError(
                f"{name}: 8-bit weights with zero points have no GGUF type; supported: symmetric"
            )
        codes = (weight.codes.astype(np.int16) - middle).astype(np.int8)
        return _blocks(GGMLQuantizationType.Q8_0, (d,), codes.view(np.uint8).reshape(out, -1, BLOCK))
    if zeros is None:
        return _blocks(GGMLQuantizationType.Q4_0, (d,), _nibbles(weight.codes))
    m = (-scales * np.repeat(zeros, repeat, axis=1).astype(np.float32)).astype(np.float16)
    return _blocks(GGMLQuantizationType.Q4_1, (d, m), _nibbles(weight.codes))


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes ``[out, in]`` as GGUF packs them: byte ``j`` of a block holds weight ``j`` in
    its low nibble and weight ``j + 16`` in its high one. Returns ``[out, in // 32, 16]``."""
    halves = codes.astype(np.uint8).reshape(codes.shape[0], -1, 2, BLOCK // 2)
    return halves[:, :, 0] | (halves[:, :, 1] << 4)


def _blocks(qtype: GGMLQuantizationType, halfs: tuple[np.ndarray, ...], qs: np.ndarray) -> QuantizedWeight:
    """Blocks of the f16 fields ``halfs`` (each ``[out, in // 32]``) followed by ``qs``."""
    out, nblocks = qs.shape[:2]
    fields = [np.ascontiguousarray(h.astype("<f2")).reshape(out, nblocks, 1).view(np.uint8) for h in halfs]
    raw = np.concatenate([*fields, qs], axis=-1).reshape(out, -1)
    return QuantizedWeight(raw, qtype, (out, nblocks * BLOCK))
