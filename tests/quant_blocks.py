"""Quantized weights in GGUF's block layouts for tests: random valid blocks of every type the
kernels take, and dense weights quantized into them.

Random blocks are random bytes with finite half scales (drawn, then written over the scale
fields): every quant pattern and scale byte occurs, and the scales include subnormal halves.
gguf-py cannot quantize the K types, so :func:`quantized` has a plain round-to-nearest
quantizer of its own for them (not ggml's search for the best scales: only the layout matters).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

Q = GGMLQuantizationType

#: the types with C kernels
TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
#: the K types, which gguf-py cannot quantize
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)

#: byte offsets of each block's half-float scales
_HALVES = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
#: a scale size per type that gives weights of about unit size times `scale`
_UNIT = {
    Q.Q4_0: 0.2,
    Q.Q4_1: 0.1,
    Q.Q5_0: 0.1,
    Q.Q5_1: 0.05,
    Q.Q8_0: 0.015,
    Q.Q4_K: 0.004,
    Q.Q5_K: 0.002,
    Q.Q6_K: 0.0003,
}


def random_blocks(
    qtype: GGMLQuantizationType, rows: int, in_features: int, seed: int, scale: float = 1.0
) -> np.ndarray:
    """``rows`` rows of ``in_features`` elements of ``qtype``: random bytes, half scales drawn
    from a normal distribution (weights of about ``scale`` in size)."""
    elements, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * in_features // elements, size), dtype=np.uint8)
    for offset in _HALVES[qtype]:
        halves = (rng.standard_normal(blocks.shape[0]) * _UNIT[qtype] * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _half(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as halves: their bytes ``[..., 2]`` and their float32 values."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(*x.shape, 2), h.astype(np.float32)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _q45_k(w: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (5) blocks of ``w`` ``[blocks, 256]``: per sub-block of 32 a scale
    and a minimum, each a 6-bit multiple of the block's half ``d`` and ``dmin``."""
    sub = w.reshape(-1, 8, 32)
    low, high = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    step, floor = (high - low) / (2**bits - 1), -low
    d_bytes, d = _half(step.max(-1) / 63)
    m_bytes, dmin = _half(floor.max(-1) / 63)
    sc = np.clip(np.rint(_ratio(step, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(floor, dmin[:, None])), 0, 63).astype(np.uint8)
    scale, minimum = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.rint(_ratio(sub + minimum[..., None], scale[..., None])), 0, 2**bits - 1).astype(np.uint8)
    packed = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            mn[:, :4] | (mn[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4,
        ],
        axis=1,
    )
    nibbles = (q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4  # [blocks, 4, 32]
    fields = [d_bytes, m_bytes, packed]
    if bits == 5:
        fields.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=1))
    return np.concatenate([*fields, nibbles.reshape(len(w), -1)], axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``w`` ``[blocks, 256]``: per sub-block of 16 an 8-bit multiple of the
    block's half ``d``, quants -32..31."""
    sub = w.reshape(-1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d_bytes, d = _half(step.max(-1) / 127)
    sc = np.clip(np.rint(_ratio(step, d[:, None])), -128, 127).astype(np.int8)
    scale = d[:, None] * sc
    q = (np.clip(np.rint(_ratio(sub, scale[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    ql = (q[:, :, :64] & 15) | (q[:, :, 64:] & 15) << 4  # [blocks, half, 64]
    qh = (
        (q[:, :, :32] >> 4)
        | (q[:, :, 32:64] >> 4) << 2
        | (q[:, :, 64:96] >> 4) << 4
        | (q[:, :, 96:] >> 4) << 6
    )
    return np.concatenate(
        [ql.reshape(len(w), -1), qh.reshape(len(w), -1), sc.view(np.uint8), d_bytes], axis=1
    )


def quantized(weight: torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    """``[out, in]`` ``weight`` in ``qtype``'s blocks ``[out, row bytes]``: gguf-py's
    quantization, or for a K type this module's."""
    w = weight.float().numpy()
    if qtype not in K_TYPES:
        return quantize(w, qtype)
    blocks = w.reshape(-1, 256)
    out = _q6_k(blocks) if qtype == Q.Q6_K else _q45_k(blocks, 4 if qtype == Q.Q4_K else 5)
    return out.reshape(weight.shape[0], -1)
