"""Quantized KV blocks: ``kv_cache_dtype`` names, the quantizer, and its inverse.

A quantized cache stores each key and value element in one byte -- fp8 (``float8_e4m3fn``) or
int8 -- and, beside the blocks, one float32 scale per token and KV head (``amax / qmax`` of that
head's ``head_dim`` values). Why per token and head rather than per block and head: a token's
scale is fixed the moment :func:`pagedkv.attention.write_kv` writes it, so paged writes (one
token at a time during decode, into a block other sequences may share) never have to re-read or
re-quantize anything already stored, copy-on-write copies scales like any other slot data, and
an outlier token cannot coarsen the quantization of its block's other tokens. On the built-in
model's keys and values it is also the more accurate choice (the relative RMS errors are in
docs/kv-cache.md; ``pagedkv bench quality`` measures what each KV cache dtype costs). The cost is
4 bytes of scale per head_dim bytes of a token's head.

Dequantization is ``stored.float() * scale``: the kernels multiply a whole dot product by the key
scale, and the converted value vector (CPU) or the softmax weight (Triton) by the value scale,
so no element is multiplied twice.
"""

from __future__ import annotations

import torch

from pagedkv.memory.kv_bytes import KV_CACHE_DTYPE_NAMES

#: ``kv_cache_dtype`` name -> the element type of the stored blocks (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
assert tuple(KV_CACHE_DTYPES) == KV_CACHE_DTYPE_NAMES  # the torch-free list the CLI offers
#: the largest magnitude each quantized type stores (448 is float8_e4m3fn's largest finite value)
QMAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
#: the scales' element type: exact enough that the scale adds no error of its own
SCALE_DTYPE = torch.float32
#: a head of all zeros gets this scale instead of 0 (so dequantizing never divides by zero)
MIN_SCALE = 1e-12


def check_kv_cache_dtype(name: str) -> torch.dtype | None:
    """The storage dtype for ``name`` (None for ``auto``), or a clear error naming the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {list(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., head_dim]`` -> (``stored [..., head_dim]`` in ``dtype``, ``scale [...]`` float32)
    with ``stored * scale ~= x``: each row's largest magnitude maps onto the type's largest."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / qmax).clamp(min=MIN_SCALE)
    scaled = (xf / scale.unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype), scale.to(SCALE_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize` (up to its rounding), in ``dtype``."""
    return (stored.float() * scale.unsqueeze(-1)).to(dtype)
