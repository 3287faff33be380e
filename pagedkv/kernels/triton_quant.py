"""Products and dequantization of weights kept in GGUF's quantized blocks, on CUDA (Triton):
the GPU twin of :mod:`pagedkv.kernels.quant_gemm`, with the same arguments.

A weight ``[N, K]`` is a ``uint8`` tensor of GGUF's bytes, ``N`` rows of whole blocks, plus its
ggml type code. :func:`quant_linear` reads the blocks in place: each program dequantizes tiles of
``BLOCK_N`` weight rows (:func:`~pagedkv.kernels.triton_quant_blocks.dequantize_tile`) into
registers and multiplies them into ``BLOCK_M`` rows of ``x``, summing in float32; the weight
is never held dense.

- Up to :data:`GEMV_ROWS` rows (decode) each product is a float32 multiply of the exact
  dequantized weight and the widened activation, summed per row: any activation dtype gets the
  float32 product, rounded once into ``out``.
- More rows (prefill, batches) go through ``tl.dot``: float32 activations multiply the float32
  weight in float32 (``ieee``: no TF32 rounding of the operands); float16 and bfloat16 ones
  multiply the weight rounded to their dtype on tensor cores, as ``F.linear`` on the dequantized
  weight in that dtype does, into float32 sums.

:func:`dequantize` writes the dense weight in any float dtype, each value bit for bit
``gguf.quants.dequantize``'s rounded once (round to nearest even).

For CPU tensors the same kernels run in Triton's interpreter (tests; :mod:`.triton_launch`),
where ``tl.dot`` always takes float32 operands (its low-precision products are not trusted
there), each the value the GPU multiplies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.quant_gemm import BLOCKS, row_bytes
from pagedkv.kernels.triton_launch import launch, to_storage
from pagedkv.kernels.triton_quant_blocks import TILES, dequantize_tile

#: activation dtypes the kernels take
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the most rows multiplied without ``tl.dot``
GEMV_ROWS = 4


def quant_matmul_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, stride_w] uint8 blocks
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N], unit column stride
    num_rows,
    N,
    K,
    stride_x,
    stride_out,
    stride_w,
    QTYPE: tl.constexpr,
    BLOCK_ELEMENTS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    SUB: tl.constexpr,
    SUB_LEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """``out[m, n] = x[m] . W[n] (+ bias[n])`` for a ``BLOCK_M x BLOCK_N`` tile of ``out``."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < num_rows
    row_offs = (n.to(tl.int64) * stride_w)[:, None, None]
    s = tl.arange(0, SUB)[None, :, None]
    k = tl.arange(0, SUB * SUB_LEN)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, SUB * SUB_LEN):
        valid = n_ok[:, None, None] & (k0 + s * SUB_LEN < K)
        tile = dequantize_tile(w_ptr, row_offs, k0, valid, QTYPE, BLOCK_ELEMENTS, BLOCK_BYTES, SUB, SUB_LEN)
        w = tl.reshape(tile, [BLOCK_N, SUB * SUB_LEN])
        x = tl.load(x_rows + (k0 + k)[None, :], mask=m_ok[:, None] & (k0 + k < K)[None, :], other=0.0)
        if DOT:
            w = to_storage(w, x.dtype)  # the weight in the activation's dtype, as F.linear holds it
            if DOT_IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m.to(tl.int64)[:, None] * stride_out + n[None, :]
    tl.store(out, to_storage(acc, out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def dequantize_kernel(
    w_ptr,  # [N, stride_w] uint8 blocks
    out_ptr,  # [N, K]
    N,
    K,
    stride_w,
    QTYPE: tl.constexpr,
    BLOCK_ELEMENTS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    SUB: tl.constexpr,
    SUB_LEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One ``BLOCK_N x (SUB * SUB_LEN)`` tile of the dense weight."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * SUB * SUB_LEN
    s = tl.arange(0, SUB)[None, :, None]
    valid = (n < N)[:, None, None] & (k0 + s * SUB_LEN < K)
    row_offs = (n.to(tl.int64) * stride_w)[:, None, None]
    tile = dequantize_tile(w_ptr, row_offs, k0, valid, QTYPE, BLOCK_ELEMENTS, BLOCK_BYTES, SUB, SUB_LEN)
    k = k0 + tl.arange(0, SUB * SUB_LEN)
    out = out_ptr + n.to(tl.int64)[:, None] * K + k[None, :]
    w = tl.reshape(tile, [BLOCK_N, SUB * SUB_LEN])
    tl.store(out, to_storage(w, out_ptr.dtype.element_ty), mask=(n < N)[:, None] & (k < K)[None, :])


def takes(x: torch.Tensor, blocks: torch.Tensor) -> bool:
    """Whether :func:`quant_linear` runs ``x`` on ``blocks`` as compiled code: both on one CUDA
    device, ``x`` of one of :data:`DTYPES`."""
    return x.device.type == "cuda" and blocks.device == x.device and x.dtype in DTYPES


def tiles(qtype: int, rows: int) -> dict[str, int | bool]:
    """The launch's tile for ``rows`` rows of ``x`` on type ``qtype``: its constexprs and
    ``num_warps``. Decode tiles hold ~2048 weights (a super-block of 8 rows, or 4 legacy
    blocks of 16); ``tl.dot`` tiles 16 to 64 rows by 32 (K types) or 64 weight rows."""
    (elements, size), (sub, sub_len) = BLOCKS[qtype], TILES[qtype]
    tile = dict(QTYPE=qtype, BLOCK_ELEMENTS=elements, BLOCK_BYTES=size, SUB=sub, SUB_LEN=sub_len)
    if rows <= GEMV_ROWS:
        block_m = 1 << max(0, (rows - 1).bit_length())
        return tile | dict(BLOCK_M=block_m, BLOCK_N=8 if elements == 256 else 16, DOT=False, num_warps=4)
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    if elements == 256:
        return tile | dict(BLOCK_M=block_m, BLOCK_N=32, DOT=True, num_warps=8)
    return tile | dict(SUB=2, BLOCK_M=block_m, BLOCK_N=64, DOT=True, num_warps=4)


def quant_linear(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """``out = x @ W.T + bias`` for the weight ``W`` in ``blocks`` of type ``qtype``: ``x``
    contiguous ``[M, K]`` of one of :data:`DTYPES`, ``out`` ``[M, N]`` of its dtype with unit
    column stride (a column slice of a wider output is written in place), ``bias`` ``[N]`` or
    None; all on one device. Returns ``out``."""
    count, in_features = x.shape
    out_features = out.shape[1]
    if not x.is_contiguous() or out.stride(1) != 1 or out.dtype != x.dtype or out.shape[0] != count:
        raise ValueError(f"x must be contiguous and out [{count}, N] of its dtype with unit column stride")
    if x.dtype not in DTYPES:
        raise ValueError(f"the quantized product takes activations of {DTYPES}, got {x.dtype}")
    size = row_bytes(qtype, in_features)
    if blocks.numel() != out_features * size or blocks.dtype != torch.uint8:
        raise ValueError(
            f"{blocks.numel()} bytes are not {out_features} rows of {in_features} of type {qtype}"
        )
    if count == 0 or out_features == 0:
        return out
    tile = tiles(qtype, count)
    ieee = x.dtype == torch.float32 or x.device.type != "cuda"
    grid = (triton.cdiv(out_features, tile["BLOCK_N"]), triton.cdiv(count, tile["BLOCK_M"]))
    launch(
        quant_matmul_kernel,
        grid,
        x.device,
        x,
        blocks,
        out if bias is None else bias,
        out,
        count,
        out_features,
        in_features,
        in_features,
        out.stride(0),
        size,
        DOT_IEEE=ieee,
        HAS_BIAS=bias is not None,
        **tile,
    )
    return out


def dequantize(
    blocks: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The ``[rows, in_features]`` weight of ``blocks`` (``uint8``, ``rows`` whole rows of
    ``qtype``) in ``dtype`` on their device."""
    rows = blocks.numel() // row_bytes(qtype, in_features)
    out = torch.empty((rows, in_features), dtype=dtype, device=blocks.device)
    if rows:
        (elements, size), (sub, sub_len) = BLOCKS[qtype], TILES[qtype]
        block_n = 16
        grid = (triton.cdiv(rows, block_n), triton.cdiv(in_features, sub * sub_len))
        launch(
            dequantize_kernel,
            grid,
            blocks.device,
            blocks,
            out,
            rows,
            in_features,
            row_bytes(qtype, in_features),
            QTYPE=qtype,
            BLOCK_ELEMENTS=elements,
            BLOCK_BYTES=size,
            SUB=sub,
            SUB_LEN=sub_len,
            BLOCK_N=block_n,
        )
    return out
