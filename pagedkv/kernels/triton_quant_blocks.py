"""GGUF's quantized blocks read in a Triton kernel: one tile of a weight's rows dequantized to
float32 in registers, every value bit for bit ``gguf.quants.dequantize``'s.

A tile is ``[BLOCK_N, SUB, SUB_LEN]``: ``BLOCK_N`` weight rows times ``SUB`` groups of
``SUB_LEN`` elements that share their scales -- for the legacy types (Q4_0 ... Q8_0) ``SUB``
whole blocks of 32, for Q4_K and Q5_K the 8 sub-blocks of 32 of one super-block, for Q6_K its 16
sub-blocks of 16 (:data:`TILES`). A group's scales are loaded once, ``[BLOCK_N, SUB, 1]``, and
broadcast over its elements; each element's quant is read from its byte where the layout
(``csrc/quant_types.h``) puts it. The caller reshapes the tile to ``[BLOCK_N, SUB * SUB_LEN]``:
consecutive elements of a row.

Exactness: a block's half-float scales widen to float32 exactly, and every product the
reference makes before its one rounding is exact in float32 (a half's 11 significant bits times
a 6-bit scale times a quant of at most 6 bits), so a fused multiply-add that a GPU compiler may
form rounds the same as the reference's multiply then add.

This module imports triton; :mod:`pagedkv.kernels.triton_quant` launches the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: ggml type code -> (SUB, SUB_LEN): a tile of one step along K (the blocks' sizes are
#: :data:`pagedkv.kernels.quant_gemm.BLOCKS`)
TILES: dict[int, tuple[int, int]] = {
    2: (4, 32),  # Q4_0: 4 blocks a step
    3: (4, 32),  # Q4_1
    6: (4, 32),  # Q5_0
    7: (4, 32),  # Q5_1
    8: (4, 32),  # Q8_0
    12: (8, 32),  # Q4_K: one super-block a step, its 8 sub-blocks of 32
    13: (8, 32),  # Q5_K
    14: (16, 16),  # Q6_K: its 16 sub-blocks of 16
}


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(ptr, mask):
    """The IEEE half at ``ptr`` (two little-endian bytes) as float32, exactly."""
    bits = _byte(ptr, mask) | (_byte(ptr + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fifth_bit(qh_ptr, i, mask):
    """Bit ``i`` (0..31) of a legacy block's 32 little-endian bits ``qh``, as bit 4."""
    return ((_byte(qh_ptr + i // 8, mask) >> (i % 8)) & 1) << 4


@triton.jit
def _k_scale_min(scales_ptr, s, mask):
    """Q4_K/Q5_K sub-block ``s``'s 6-bit scale and minimum from the 12 packed bytes: for s < 4
    the low 6 bits of bytes s and s + 4; above, byte s + 4's nibbles under the top two bits of
    bytes s - 4 and s."""
    j = s % 4
    low_sc = _byte(scales_ptr + j, mask)
    low_m = _byte(scales_ptr + j + 4, mask)
    high = _byte(scales_ptr + j + 8, mask)
    sc = tl.where(s < 4, low_sc & 63, (high & 15) | ((low_sc >> 6) << 4))
    m = tl.where(s < 4, low_m & 63, (high >> 4) | ((low_m >> 6) << 4))
    return sc, m


@triton.jit
def dequantize_tile(
    w_ptr,  # uint8 weight blocks
    row_offs,  # [BLOCK_N, 1, 1] int64: each row's first byte
    k0,  # the tile's first element inside a row (a multiple of SUB * SUB_LEN)
    valid,  # [BLOCK_N, SUB, 1]: the row exists and the group is inside it
    QTYPE: tl.constexpr,
    BLOCK_ELEMENTS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    SUB: tl.constexpr,
    SUB_LEN: tl.constexpr,
):
    """``[BLOCK_N, SUB, SUB_LEN]`` float32 weights of the tile starting at element ``k0``
    (zeros where not ``valid``)."""
    s = tl.arange(0, SUB)[None, :, None]
    i = tl.arange(0, SUB_LEN)[None, None, :]
    if BLOCK_ELEMENTS == 256:  # the tile is one super-block
        base = w_ptr + row_offs + (k0 // 256) * BLOCK_BYTES
    else:  # SUB legacy blocks
        base = w_ptr + row_offs + (k0 // 32 + s).to(tl.int64) * BLOCK_BYTES
    if QTYPE == 2:  # Q4_0: d * (q - 8), q nibble i // 16 of qs[i % 16]
        q = (_byte(base + 2 + i % 16, valid) >> (4 * (i // 16))) & 15
        w = _half(base, valid) * (q - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1: d * q + m
        q = (_byte(base + 4 + i % 16, valid) >> (4 * (i // 16))) & 15
        w = _half(base, valid) * q.to(tl.float32) + _half(base + 2, valid)
    elif QTYPE == 6:  # Q5_0: d * (q - 16), q's bit 4 from qh
        q = ((_byte(base + 6 + i % 16, valid) >> (4 * (i // 16))) & 15) | _fifth_bit(base + 2, i, valid)
        w = _half(base, valid) * (q - 16).to(tl.float32)
    elif QTYPE == 7:  # Q5_1: d * q + m
        q = ((_byte(base + 8 + i % 16, valid) >> (4 * (i // 16))) & 15) | _fifth_bit(base + 4, i, valid)
        w = _half(base, valid) * q.to(tl.float32) + _half(base + 2, valid)
    elif QTYPE == 8:  # Q8_0: signed bytes times d
        q = tl.load(base + 2 + i, mask=valid, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _half(base, valid)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K/Q5_K: d * sc * q - dmin * m per sub-block of 32
        sc, m = _k_scale_min(base + 4, s, valid)
        scale = _half(base, valid) * sc.to(tl.float32)
        minimum = _half(base + 2, valid) * m.to(tl.float32)
        if QTYPE == 12:
            q = (_byte(base + 16 + 32 * (s // 2) + i, valid) >> (4 * (s % 2))) & 15
        else:
            q = (_byte(base + 48 + 32 * (s // 2) + i, valid) >> (4 * (s % 2))) & 15
            q = q | (((_byte(base + 16 + i, valid) >> s) & 1) << 4)
        w = scale * q.to(tl.float32) - minimum
    else:  # Q6_K: d * scales[e / 16] * (q - 32), element e = 16 s + i of halves of 128
        e = 16 * s + i
        half = e // 128
        r = e % 128
        low = (_byte(base + 64 * half + r % 64, valid) >> (4 * (r // 64))) & 15
        high = ((_byte(base + 128 + 32 * half + r % 32, valid) >> (2 * (r // 32))) & 3) << 4
        sc = tl.load(base + 192 + s, mask=valid, other=0).to(tl.int8, bitcast=True)
        scale = _half(base + 208, valid) * sc.to(tl.float32)
        w = scale * ((low | high) - 32).to(tl.float32)
    return w
