"""Products and dequantization of weights kept in GGUF's quantized blocks, on the CPU
(``csrc/quant_gemm.c``, block layouts in ``csrc/quant_types.h``).

A quantized weight ``[N, K]`` is a ``uint8`` tensor of GGUF's bytes, ``N`` rows of ``K / elements``
blocks each, plus its ggml type code (``gguf.GGMLQuantizationType``'s value: this package imports no
gguf). :func:`quant_linear` multiplies float32 or bfloat16 activations by it without a dense copy:
up to a few rows (decode) each block is dequantized into registers inside the dot products; more
rows (prefill) dequantize a tile of 64 weight rows at a time for the tiled GEMM's loop. In bfloat16
on a CPU with AMX, from a few rows, the product is instead the dense bfloat16 one of the weight
rounded to bfloat16: panels of weight rows are dequantized straight into AMX tile rows
(``csrc/quant_amx.h``). :func:`dequantize` equals ``gguf.quants.dequantize`` bit for bit. With
``q8`` the product is llama.cpp's instead (``csrc/quant_dot.c``): each activation row rounded to
8-bit blocks (:func:`quantize_activations`), integer dot products, one scale per block.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedkv.kernels import library
from pagedkv.kernels.library import Entry
from pagedkv.kernels.signatures import SUFFIXES

#: ggml type code -> (elements, bytes) per block, for the types the C source has
BLOCKS: dict[int, tuple[int, int]] = {
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}

#: activation dtypes the C product takes
DTYPES = (torch.float32, torch.bfloat16)
#: rows up to which the "q8" products are the faster (each row costs them more than the float
#: product, which dequantizes a block once for every row: past a few rows it wins)
Q8_DECODE_ROWS = 4
#: activation block formats of :func:`quantize_activations`, by ggml type code: (elements, bytes)
ACTIVATION_BLOCKS: dict[int, tuple[int, int]] = {8: (32, 34), 15: (256, 292)}  # Q8_0, Q8_K


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one weight row of ``in_features`` elements of type ``qtype``; ValueError for a
    type without a kernel or a row that is not a whole number of blocks."""
    if qtype not in BLOCKS:
        raise ValueError(f"no quantized kernel for ggml type {qtype}")
    elements, size = BLOCKS[qtype]
    if in_features % elements:
        raise ValueError(
            f"a row of ggml type {qtype} holds a multiple of {elements} elements, got {in_features}"
        )
    return in_features // elements * size


@functools.cache
def _entry(name: str, dtype: torch.dtype) -> Entry:
    return library.load().entry(f"{name}_{SUFFIXES[dtype]}")


def dequantize(
    blocks: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The ``[rows, in_features]`` weight of CPU ``blocks`` (``uint8``, ``rows`` rows of
    :func:`row_bytes`) in ``dtype`` (float32, or bfloat16 rounded to nearest even)."""
    rows = blocks.numel() // row_bytes(qtype, in_features)
    out = torch.empty((rows, in_features), dtype=dtype)
    status = _entry("quant_dequantize", dtype)(blocks.data_ptr(), qtype, out.data_ptr(), rows, in_features)
    if status:
        raise MemoryError("dequantizing a quantized weight could not allocate its workspace")
    return out


def quant_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    q8: bool = False,
) -> torch.Tensor:
    """``out = x @ W.T + bias`` for the weight ``W`` in CPU ``blocks`` of type ``qtype``: ``x``
    contiguous ``[M, K]`` float32 or bfloat16, ``out`` ``[M, N]`` of its dtype with unit column
    stride (a column slice of a wider output is written in place), ``bias`` ``[N]`` of its dtype
    or None. ``q8``: each row of ``x`` rounded to 8-bit blocks first and integer products summed,
    as llama.cpp does (``csrc/quant_dot.c``); else ``x`` as it is, the weights exactly as
    dequantized, float32 sums. Returns ``out``."""
    count, in_features = x.shape
    out_features = out.shape[1]
    if not x.is_contiguous() or out.stride(1) != 1 or out.dtype != x.dtype or out.shape[0] != count:
        raise ValueError(f"x must be contiguous and out [{count}, N] of its dtype with unit column stride")
    if blocks.numel() != out_features * row_bytes(qtype, in_features):
        raise ValueError(
            f"{blocks.numel()} bytes are not {out_features} rows of {in_features} of type {qtype}"
        )
    if count:
        name = "quant_linear_q8" if q8 else "quant_linear"
        status = _entry(name, x.dtype)(
            x.data_ptr(),
            blocks.data_ptr(),
            qtype,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            count,
            in_features,
            out_features,
            out.stride(0),
        )
        if status:
            raise MemoryError("the quantized product could not allocate its workspace")
    return out


def quantize_activations(x: torch.Tensor, fmt: int) -> torch.Tensor:
    """The rows of float32 ``x`` ``[M, K]`` rounded to 8-bit blocks of ggml type ``fmt`` as the
    ``q8`` product rounds them, as bytes ``[M, K / elements * bytes]``: Q8_0 (8) in GGUF's layout,
    Q8_K (15) in ggml's ``block_q8_K`` (float scale, 256 quants, 16 sums of 16)."""
    if fmt not in ACTIVATION_BLOCKS:
        raise ValueError(f"no activation blocks of ggml type {fmt}")
    elements, size = ACTIVATION_BLOCKS[fmt]
    rows, in_features = x.shape
    if in_features % elements or x.dtype != torch.float32:
        raise ValueError(f"float32 rows of a multiple of {elements} elements, got {x.dtype} {in_features}")
    x = x.contiguous()
    out = torch.empty((rows, in_features // elements * size), dtype=torch.uint8)
    if library.load().entry("quant_activations_f32")(x.data_ptr(), fmt, out.data_ptr(), rows, in_features):
        raise MemoryError("rounding activations could not allocate its workspace")
    return out


def dot_instructions() -> str:
    """The instruction set of the ``q8`` products' integer dot products here: "avx512-vnni",
    "avx-vnni", "avx2" or "portable"."""
    return ctypes.string_at(library.load().entry("quant_dot_isa")()).decode()
