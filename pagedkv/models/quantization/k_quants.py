"""llama.cpp's Q4_K quantizer (``quantize_row_q4_K_ref`` with ``make_qkx2_quants``, ggml-quants.c)
in numpy, over every sub-block of a matrix at once.

A Q4_K super-block holds 256 weights as 8 sub-blocks of 32: ``w = d * sc[j] * q - dmin * m[j]``
with 4-bit codes ``q``, 6-bit sub-block scales ``sc`` and mins ``m``, and f16 ``d`` and ``dmin``.
Each sub-block's scale and min are fitted by ``make_qkx2_quants``: a weighted least-squares fit
(weights ``rms(x) + |x|``) tried at 21 grid stretches, keeping the one with the least weighted
squared error; as in C, a better fit's min moves the grid of the tries after it. Then the 8 scales
and mins are quantized to 6 bits against the super-block's largest, and the codes recomputed with
the quantized values. Sums run in float32 one term after the other, in C's order (``_sum``), so the
blocks are llama.cpp's bit for bit; ``gguf.quants`` has no Q4_K quantizer.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
SUB = 32
#: make_qkx2_quants' arguments for Q4_K: codes 0..15, grid stretches -1.0 + 0.1 * (0..20).
_NMAX, _RMIN, _RDELTA, _NSTEP = 15, np.float32(-1.0), np.float32(0.1), 20
#: Super-blocks quantized at once: bounds the fit's float32 temporaries to a few MiB each.
CHUNK = 4096


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float ``[n, k]`` (``k`` a multiple of 256) -> Q4_K blocks, uint8 ``[n, k / 256 * 144]``."""
    n, k = rows.shape
    if k % QK_K:
        raise ValueError(f"Q4_K rows hold multiples of {QK_K} weights, not {k}")
    blocks = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, QK_K)
    chunks = [_super_blocks(blocks[i : i + CHUNK]) for i in range(0, len(blocks), CHUNK)]
    return np.concatenate(chunks).reshape(n, -1)


def _super_blocks(blocks: np.ndarray) -> np.ndarray:
    """float32 ``[m, 256]`` -> Q4_K blocks ``[m, 144]``."""
    x = blocks.reshape(-1, SUB)  # sub-blocks
    weights = np.sqrt(_sum(x * x) / np.float32(SUB))[:, None] + np.abs(x)
    scales, mins, codes = _make_qkx2(x, weights)
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale = np.maximum(scales.max(axis=1), 0)
    max_min = np.maximum(mins.max(axis=1), 0)
    ls = _six_bits(scales, max_scale)
    lm = _six_bits(mins, max_min)
    d = (max_scale / np.float32(63)).astype(np.float16)
    dmin = (max_min / np.float32(63)).astype(np.float16)

    sub_d = (d.astype(np.float32)[:, None] * ls).reshape(-1, 1)
    sub_m = (dmin.astype(np.float32)[:, None] * lm).reshape(-1, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requantized = np.clip(np.rint((x + sub_m) / sub_d), 0, 15)
    codes = np.where(sub_d != 0, requantized, codes).astype(np.uint8)  # d == 0: make_qkx2's codes

    halves = codes.reshape(-1, 4, 2, SUB)  # [super-block, 64-weight chunk, low/high, 32]
    qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, QK_K // 2)
    packed_scales = np.concatenate(
        [
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    ).astype(np.uint8)
    halfs = [np.ascontiguousarray(h.astype("<f2")).reshape(-1, 1).view(np.uint8) for h in (d, dmin)]
    return np.concatenate([*halfs, packed_scales, qs], axis=1)


def _six_bits(values: np.ndarray, largest: np.ndarray) -> np.ndarray:
    """``values`` ``[blocks, 8]`` as 6-bit multiples of ``largest / 63`` (0 where ``largest`` is)."""
    inverse = np.where(largest > 0, np.float32(63) / np.where(largest > 0, largest, 1), 0)
    return np.clip(np.rint(inverse[:, None] * values), 0, 63).astype(np.uint8)


def _make_qkx2(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants on every row of ``x`` ``[m, 32]`` with weights ``w``: the scale, the min
    (positive: the row's value at code 0 is ``-min``) and the codes of the best fit."""
    lo = np.minimum(x.min(axis=1), 0)
    hi = x.max(axis=1)
    flat = hi == lo
    sum_w = _sum(w)
    sum_x = _sum(w * x)

    def grid(stretch: np.floating, lo: np.ndarray) -> np.ndarray:
        span = np.where(flat, 1, hi - lo)
        return np.clip(np.rint((stretch / span)[:, None] * (x - lo[:, None])), 0, _NMAX)

    codes = grid(np.float32(_NMAX), lo)
    scale = np.float32(1) / (np.float32(_NMAX) / np.where(flat, 1, hi - lo))
    best = _sum(w * np.square(scale[:, None] * codes + lo[:, None] - x))
    for step in range(_NSTEP + 1):
        trial = grid(_RMIN + _RDELTA * np.float32(step) + np.float32(_NMAX), lo)
        sum_l = _sum(w * trial)
        sum_l2 = _sum(w * trial * trial)
        sum_xl = _sum(w * trial * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        solvable = det > 0
        det = np.where(solvable, det, 1)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0  # the fit must reach down to 0: refit the scale alone
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, 1), this_scale)
        this_min = np.where(positive, 0, this_min)
        error = _sum(w * np.square(this_scale[:, None] * trial + this_min[:, None] - x))
        better = solvable & (error < best) & ~flat
        codes = np.where(better[:, None], trial, codes)
        best = np.where(better, error, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    scale = np.where(flat, 0, scale).astype(np.float32)
    codes = np.where(flat[:, None], 0, codes)
    return scale, (-lo).astype(np.float32), codes


def _sum(terms: np.ndarray) -> np.ndarray:
    """Each row's sum in float32, added left to right as the C loops add (numpy's own sum pairs
    terms up, which rounds differently and may flip which fit wins)."""
    return np.cumsum(terms, axis=1, dtype=np.float32)[:, -1]
