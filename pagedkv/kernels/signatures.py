"""Every entry point of the kernels library that Python calls, as ctypes sees it: written once,
here, after the prototypes in ``csrc/kernels.h``.

ctypes cannot read a C header, so the two are kept together by a test
(``tests/kernels/test_signatures.py`` parses the header and compares). :mod:`.library` gives each
entry point its signature when it loads the library; nothing else declares one. Tensors travel
as addresses (``data_ptr()``), ``None`` for an absent one.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import torch

ADDRESS, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

#: an entry point's suffix for tensors of a dtype
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
#: a quantized KV pool's suffix, after the query's (``paged_attention_rows_bf16_fp8``)
POOL_SUFFIXES = {torch.float8_e4m3fn: "fp8", torch.int8: "i8"}


@dataclass(frozen=True)
class Signature:
    """What an entry point returns (``None``: nothing) and the ctypes of its arguments."""

    result: type | None
    arguments: tuple[type, ...]


_LAYER = ("f32", "bf16", "f16")  # f16 is missing from builds without _Float16
_TILED = ("f32", "bf16")
_ROWS = ("f32", "bf16", "f16", "f32_fp8", "f32_i8", "bf16_fp8", "bf16_i8", "f16_fp8", "f16_i8")

#: ``(name, suffixes, signature)``: entry point ``<name>_<suffix>`` for each suffix, or ``name``
#: alone for none
_FAMILIES: tuple[tuple[str, tuple[str, ...], Signature], ...] = (
    # layer_ops.c
    ("rms_norm", _LAYER, Signature(None, (ADDRESS, ADDRESS, ADDRESS, I64, I64, F32))),
    ("add_rms_norm", _LAYER, Signature(None, (ADDRESS, ADDRESS, ADDRESS, I64, I64, F32))),
    ("silu_and_mul", _LAYER, Signature(None, (ADDRESS, ADDRESS, I64, I64))),
    (
        "rotary_write_kv",
        _LAYER,
        Signature(None, (ADDRESS,) * 6 + (F32, ADDRESS, ADDRESS, ADDRESS) + (I64,) * 5),
    ),
    ("layer_ops_max_head_dim", (), Signature(I64, ())),
    ("offset_rms_norm", _LAYER, Signature(None, (ADDRESS, ADDRESS, ADDRESS, I64, I64, F32))),
    ("add_offset_rms_norm", _LAYER, Signature(None, (ADDRESS, ADDRESS, ADDRESS, I64, I64, F32))),
    ("gelu_tanh_and_mul", _LAYER, Signature(None, (ADDRESS, ADDRESS, I64, I64))),
    ("moe_experts", _TILED, Signature(INT, (ADDRESS,) * 3 + (I64,) * 7)),
    # tiled_gemm.c
    ("tiled_linear", _TILED, Signature(INT, (ADDRESS,) * 4 + (I64,) * 3)),
    ("tiled_gate_up", _TILED, Signature(INT, (ADDRESS,) * 3 + (I64,) * 3 + (INT,))),
    ("tiled_rows", (), Signature(INT, (ADDRESS,) * 3 + (I64,) * 5)),
    ("tiled_gemm_tile_width", (), Signature(I64, ())),
    ("tiled_gemm_bf16_loop", (), Signature(I64, ())),
    ("tiled_gemm_amx_rows", (), Signature(I64, ())),
    # quant_gemm.c
    ("quant_dequantize", _TILED, Signature(INT, (ADDRESS, I64, ADDRESS, I64, I64))),
    ("quant_linear", _TILED, Signature(INT, (ADDRESS, ADDRESS, I64, ADDRESS, ADDRESS) + (I64,) * 4)),
    # quant_dot.c
    ("quant_linear_q8", _TILED, Signature(INT, (ADDRESS, ADDRESS, I64, ADDRESS, ADDRESS) + (I64,) * 4)),
    ("quant_activations", ("f32",), Signature(INT, (ADDRESS, I64, ADDRESS, I64, I64))),
    ("quant_dot_isa", (), Signature(ADDRESS, ())),
    # paged_attention.c
    (
        "paged_attention_rows",
        _ROWS,
        Signature(INT, (ADDRESS,) * 9 + (I64,) * 6 + (F32, I64, F32, I64, INT)),
    ),
    ("paged_attention_prefill", _LAYER, Signature(INT, (ADDRESS,) * 9 + (I64,) * 6 + (F32, INT))),
    ("paged_attention_prefill_lanes", (), Signature(I64, ())),
    # lora_bgmv.c
    ("lora_bgmv", _TILED, Signature(INT, (ADDRESS,) * 7 + (I64,) * 6)),
    ("lora_bgmv_paged", _TILED, Signature(INT, (ADDRESS,) * 7 + (I64,) * 6)),
    # decode_stack.c
    (
        "decode_stack",
        _TILED,
        Signature(INT, (ADDRESS, I64, ADDRESS, I64) + (ADDRESS,) * 9),
    ),
)


#: entry point name -> its signature
SIGNATURES: dict[str, Signature] = {
    f"{name}_{suffix}" if suffix else name: signature
    for name, suffixes, signature in _FAMILIES
    for suffix in suffixes or ("",)
}


def _fields(ctype: type, names: str) -> list[tuple[str, type]]:
    return [(name, ctype) for name in names.split()]


class DecodeCode(enum.IntEnum):
    """``DecodeCode`` of ``kernels.h`` (``DECODE_<name>``): what a :class:`DecodeOp` runs."""

    COPY = 0
    NORM = 1
    ADD_NORM = 2
    LINEAR = 3
    ROTARY_WRITE_KV = 4
    ATTEND = 5
    GATE_UP_SILU = 6
    QUANT_LINEAR = 7
    SILU_AND_MUL = 8
    OFFSET_NORM = 9
    ADD_OFFSET_NORM = 10
    GATE_UP = 11
    GELU_TANH_AND_MUL = 12
    MOE_EXPERTS = 13
    LORA = 14
    LORA_PAGED = 15


class DecodeBuffer(enum.IntEnum):
    """``DecodeBuffer`` of ``kernels.h`` (``DECODE_<name>``): the buffers every decode stack has,
    at fixed indexes; its working buffers follow from ``WORK`` on."""

    INPUT = 0
    RESIDUAL = 1
    OUTPUT = 2
    WORK = 3


class DecodeOp(ctypes.Structure):
    """``DecodeOp`` of ``kernels.h``: one step of the decode stack's loop."""

    _fields_ = _fields(I64, "code src dst")
    _fields_ += _fields(ADDRESS, "weight bias q_norm k_norm key_pool value_pool")
    _fields_ += _fields(F32, "eps scale soft_cap")
    _fields_ += _fields(
        I64, "n_in n_out heads kv_heads head_dim block_size window split qtype column columns"
    )
    _fields_ += _fields(I64, "group offset rope")
    _fields_ += _fields(I64, "experts top_k expert_rows shared_rows moe_flags")
    _fields_ += _fields(ADDRESS, "lora_b lora_columns lora_slot lora_scaling")
    _fields_ += _fields(I64, "lora_slots lora_rank lora_shards")
    _fields_ += _fields(I64, "q8_rows")
