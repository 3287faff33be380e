"""The quantized kernels (csrc/quant_gemm.c) against gguf-py and dense products: dequantization
bit for bit, products to float32 rounding, the prefill path bit for bit the tiled GEMM's on the
dequantized weight, bfloat16 as float32 rounded once (or, above the register path on AMX, the dense
bfloat16 AMX product of the rounded weight, bit for bit)."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from pagedkv import cbuild
from pagedkv.kernels import library, quant_gemm
from pagedkv.kernels.library import KernelLibrary
from pagedkv.kernels.tiled_gemm import amx_rows, tiled_linear, to_tiles
from tests.quant_blocks import K_TYPES, TYPES, random_blocks

ROWS = (1, 3, 6, 17, 45, 64, 100)  # register path to GEMV_ROWS, batch path to 64, tile path; bf16 AMX from 5
AMX_QUANT_ROWS = 5  # quant_amx.h's
GEMV_ROWS = 12  # quant_gemm.c's


def _in_features(qtype) -> int:
    return 512 if qtype in K_TYPES else 160


def _weight(qtype, out_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of ``qtype`` as a tensor, and gguf-py's dequantization of them."""
    blocks = random_blocks(qtype, out_features, _in_features(qtype), seed)
    return torch.from_numpy(blocks), torch.from_numpy(gguf_dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantization_equals_gguf_bit_for_bit(qtype):
    blocks, reference = _weight(qtype, 37, seed=int(qtype))
    got = quant_gemm.dequantize(blocks, int(qtype), _in_features(qtype))
    assert torch.equal(got.view(torch.int32), reference.view(torch.int32))
    as_bf16 = quant_gemm.dequantize(blocks, int(qtype), _in_features(qtype), torch.bfloat16)
    assert torch.equal(as_bf16.view(torch.int16), reference.to(torch.bfloat16).view(torch.int16))


def _rounding_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """What float32 sums of ``x @ dense.T`` may differ from the exact one by, in any order."""
    k = x.shape[1]
    return k * 2.0**-23 * (x.double().abs() @ dense.double().abs().T) + 1e-30


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_float32_product_is_the_dense_one_to_rounding(qtype, rows):
    blocks, dense = _weight(qtype, 77, seed=rows)
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(77)
    out = torch.empty(rows, 77)
    got = quant_gemm.quant_linear(x, blocks, int(qtype), bias, out)
    exact = x.double() @ dense.double().T + bias.double()
    assert ((got.double() - exact).abs() <= _rounding_bound(x, dense) + exact.abs() * 2.0**-23).all()
    if rows > GEMV_ROWS:  # the tile path: the tiled GEMM on the dequantized weight, bit for bit
        assert torch.equal(got, tiled_linear(x, to_tiles(dense), bias))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_bfloat16_is_the_float32_product_rounded_once_or_on_amx_the_dense_bfloat16_one(qtype, rows):
    """Below AMX_QUANT_ROWS rows (and at any count without AMX) bfloat16 is the float32 product of
    the widened rows rounded once; from there on AMX it is the dense AMX product of the weight
    rounded to bfloat16, bit for bit (the weight as tile rows, the sums transposed back)."""
    blocks, dense = _weight(qtype, 77, seed=100 + rows)
    x = torch.randn(rows, dense.shape[1]).to(torch.bfloat16)
    bias = torch.randn(77).to(torch.bfloat16)
    got = quant_gemm.quant_linear(x, blocks, int(qtype), bias, torch.empty(rows, 77, dtype=torch.bfloat16))
    if rows >= AMX_QUANT_ROWS and amx_rows():
        expected = tiled_linear(x, to_tiles(dense.to(torch.bfloat16)), bias)
        weight = dense.to(torch.bfloat16).float()
    else:
        wide = quant_gemm.quant_linear(x.float(), blocks, int(qtype), bias.float(), torch.empty(rows, 77))
        expected, weight = wide.to(torch.bfloat16), dense
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    exact = x.double() @ weight.double().T + bias.double()
    slack = _rounding_bound(x.float(), weight) + exact.abs() * 2.0**-8
    assert ((got.double() - exact).abs() <= slack).all()


@pytest.mark.parametrize("rows", [2, 40])
def test_a_part_writes_only_its_columns_of_a_wider_output(rows):
    blocks, dense = _weight(TYPES[0], 21, seed=7)
    x = torch.randn(rows, dense.shape[1])
    wide = torch.full((rows, 50), 7.0)
    quant_gemm.quant_linear(x, blocks, int(TYPES[0]), None, wide[:, 10:31])
    alone = quant_gemm.quant_linear(x, blocks, int(TYPES[0]), None, torch.empty(rows, 21))
    assert torch.equal(wide[:, 10:31], alone)
    assert (wide[:, :10] == 7.0).all() and (wide[:, 31:] == 7.0).all()


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quant_gemm.row_bytes(int(K_TYPES[0]), 320)
    with pytest.raises(ValueError, match="no quantized kernel"):
        quant_gemm.row_bytes(1, 320)  # F16: a dense type
    blocks = torch.from_numpy(np.zeros((4, 34), dtype=np.uint8))
    with pytest.raises(ValueError, match="bytes are not"):
        quant_gemm.quant_linear(torch.zeros(1, 32), blocks, int(TYPES[0]), None, torch.empty(1, 5))


def _builds() -> list[tuple[str, ...]]:
    """Flag sets whose vector code differs from the native build's: portable C (4 lanes, no F16C),
    and on x86 with AVX2 the 8-lane AVX2 code (the native build here may be AVX-512's)."""
    builds = [("-O2", "-fopenmp", "-DPAGEDKV_NO_F16")]
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if platform.machine() == "x86_64" and " avx2 " in flags and " f16c " in flags and " fma " in flags:
        builds.append(("-O2", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DPAGEDKV_NO_F16"))
    return builds


@pytest.mark.parametrize("flags", _builds(), ids=lambda f: "avx2" if "-mavx2" in f else "portable")
def test_other_instruction_sets_dequantize_bit_for_bit_and_multiply_to_rounding(flags):
    """Each type's block code has a generic form and, on AVX-512, a table-picking one: every
    build dequantizes every type as gguf-py does, and its one-row product is the dense one to
    float32 rounding."""
    sources = [library.CSRC / name for name in ("quant_gemm.c", "tiled_gemm.c", "layer_ops.c")]
    other = KernelLibrary(
        cbuild.build_library("quant_gemm_" + flags[1].lstrip("-"), sources, flag_sets=[flags])
    )
    for qtype in TYPES:
        blocks, reference = _weight(qtype, 37, seed=int(qtype) + 1)
        K = _in_features(qtype)
        got = torch.empty(37, K)
        assert other.entry("quant_dequantize_f32")(blocks.data_ptr(), int(qtype), got.data_ptr(), 37, K) == 0
        assert torch.equal(got.view(torch.int32), reference.view(torch.int32)), qtype.name
        x, out = torch.randn(1, K), torch.empty(1, 37)
        args = (x.data_ptr(), blocks.data_ptr(), int(qtype), None, out.data_ptr(), 1, K, 37, 37)
        assert other.entry("quant_linear_f32")(*args) == 0
        exact = x.double() @ reference.double().T
        assert ((out.double() - exact).abs() <= _rounding_bound(x, reference) + exact.abs() * 2.0**-23).all()
