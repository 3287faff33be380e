"""The "q8" products (csrc/quant_dot.c): activations rounded to 8-bit blocks as ggml rounds them
(Q8_0 bit for bit gguf-py's quantizer, Q8_K ggml's reference quantizer), each product the float64
sum of the exact weights times the rounded activations to float32 rounding, every instruction
set's build the same, and a row's result the same in any batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagedkv import cbuild
from pagedkv.kernels import library, quant_gemm
from pagedkv.kernels.library import KernelLibrary
from tests.kernels.test_quant_gemm import _builds
from tests.quant_blocks import _HALVES, K_TYPES, TYPES, Q, random_blocks

Q8_0, Q8_K = 8, 15


def _in_features(qtype) -> int:
    return 512 if qtype in K_TYPES else 192


def _q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref in numpy: ``block_q8_K`` bytes of float32 ``x`` [rows, K]."""
    blocks = x.reshape(-1, 256)
    out = np.zeros((blocks.shape[0], 292), dtype=np.uint8)
    for i, block in enumerate(blocks):
        peak = block[np.argmax(np.abs(block))]  # the first element of the largest magnitude
        if peak == 0:
            continue
        iscale = np.float32(-127.0) / peak
        qs = np.minimum(np.rint(iscale * block), 127).astype(np.int8)
        out[i, :4] = np.frombuffer(np.float32(1.0 / iscale).tobytes(), np.uint8)
        out[i, 4:260] = qs.view(np.uint8)
        out[i, 260:] = qs.reshape(16, 16).astype(np.int16).sum(axis=1).astype(np.int16).view(np.uint8)
    return out.reshape(x.shape[0], -1)


def _activation_values(x: np.ndarray, qtype) -> np.ndarray:
    """The rounded activations' values (float64): d times each quant, in ggml's formats."""
    if qtype in K_TYPES:
        blocks = _q8_k(x).reshape(-1, 292)
        d = blocks[:, :4].copy().view(np.float32).astype(np.float64)
        return (d * blocks[:, 4:260].view(np.int8)).reshape(x.shape)
    return gguf_dequantize(gguf_quantize(x, Q.Q8_0), Q.Q8_0).astype(np.float64).reshape(x.shape)


def _exact_weight(blocks: np.ndarray, qtype) -> np.ndarray:
    """The weights as the blocks define them, in float64: types with a minimum are dequantized
    with it zeroed and alone (each exact in float32) and the two added in float64."""
    if len(_HALVES[qtype]) == 1:
        return gguf_dequantize(blocks, qtype).astype(np.float64)
    scale, minimum = (blocks.copy() for _ in range(2))
    scale[:, 2 :: _row_block(qtype)] = scale[:, 3 :: _row_block(qtype)] = 0  # minimum (or dmin) zeroed
    minimum[:, 0 :: _row_block(qtype)] = minimum[:, 1 :: _row_block(qtype)] = 0  # scale d zeroed
    return gguf_dequantize(scale, qtype).astype(np.float64) + gguf_dequantize(minimum, qtype)


def _row_block(qtype) -> int:
    return {Q.Q4_1: 20, Q.Q5_1: 24, Q.Q4_K: 144, Q.Q5_K: 176}[qtype]


def _scheme_and_bound(x: torch.Tensor, blocks: np.ndarray, qtype) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's product in float64 (exact weights times the rounded activations), and what
    float32 sums of its per-block terms may differ from it by."""
    a = torch.from_numpy(_activation_values(x.numpy(), qtype))
    w = torch.from_numpy(_exact_weight(blocks, qtype))
    terms = a.abs() @ w.abs().T
    return a @ w.T, (x.shape[1] / 32 + 8) * 2.0**-23 * terms + 1e-30


def test_q8_0_activations_are_gguf_quantize_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    # row scales down to 1e-9: scales that are subnormal halves
    x = torch.randn(5, 256, generator=g) * torch.logspace(-9, 3, 5).unsqueeze(1)
    x[1, :32] = 0.0  # a block of zeros: scale 0
    x[3, 32:64] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5] + [1.5] * 27)  # d = 1: exact ties, away from 0
    got = quant_gemm.quantize_activations(x, Q8_0)
    assert np.array_equal(got.numpy(), gguf_quantize(x.numpy(), Q.Q8_0).reshape(5, -1))


def test_q8_k_activations_are_ggml_reference_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 512, generator=g) * 3
    x[1, :256] = 0.0
    x[2, 256:] = torch.tensor([-127.0] + [2.5, -3.5, 0.5] * 85)  # ties to even
    assert np.array_equal(quant_gemm.quantize_activations(x, Q8_K).numpy(), _q8_k(x.numpy()))


@pytest.mark.parametrize("rows", (1, 3, 6))  # quant_dot.c takes rows 4 at a time
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_q8_product_is_llamacpps_scheme_to_float32_rounding(qtype, rows):
    blocks = random_blocks(qtype, 37, _in_features(qtype), seed=rows)
    x = torch.randn(rows, _in_features(qtype), generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(37)
    got = quant_gemm.quant_linear(
        x, torch.from_numpy(blocks), int(qtype), bias, torch.empty(rows, 37), q8=True
    )
    scheme, bound = _scheme_and_bound(x, blocks, qtype)
    assert ((got.double() - scheme - bias.double()).abs() <= bound + bias.double().abs() * 2.0**-23).all()
    # it is not the float product: the activations were rounded
    dense = torch.from_numpy(_exact_weight(blocks, qtype))
    assert not torch.allclose(got.double(), x.double() @ dense.T + bias.double(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("qtype", (Q.Q5_0, Q.Q4_K), ids=lambda q: q.name)
def test_bfloat16_rows_are_widened_and_the_result_rounded_once(qtype):
    blocks = torch.from_numpy(random_blocks(qtype, 21, _in_features(qtype), seed=3))
    x = torch.randn(2, _in_features(qtype)).to(torch.bfloat16)
    bias = torch.randn(21).to(torch.bfloat16)
    got = quant_gemm.quant_linear(
        x, blocks, int(qtype), bias, torch.empty(2, 21, dtype=torch.bfloat16), q8=True
    )
    wide = quant_gemm.quant_linear(x.float(), blocks, int(qtype), bias.float(), torch.empty(2, 21), q8=True)
    assert torch.equal(got.view(torch.int16), wide.to(torch.bfloat16).view(torch.int16))


def test_a_rows_result_does_not_depend_on_the_other_rows():
    blocks = torch.from_numpy(random_blocks(Q.Q5_0, 19, 192, seed=4))
    x = torch.randn(9, 192)
    together = quant_gemm.quant_linear(x, blocks, int(Q.Q5_0), None, torch.empty(9, 19), q8=True)
    for row in range(9):
        alone = quant_gemm.quant_linear(
            x[row : row + 1], blocks, int(Q.Q5_0), None, torch.empty(1, 19), q8=True
        )
        assert torch.equal(together[row], alone[0])


@pytest.mark.parametrize("flags", _builds(), ids=lambda f: "avx2" if "-mavx2" in f else "portable")
def test_other_instruction_sets_round_and_multiply_alike(flags):
    """The portable and AVX2 builds round the activations bit for bit as the native one and
    compute the same integer sums: their products are llama.cpp's scheme to the same bound, and
    AVX2's (the same fused float steps) equal the native build's bit for bit."""
    sources = [library.CSRC / n for n in ("quant_dot.c", "quant_gemm.c", "tiled_gemm.c", "layer_ops.c")]
    name = "quant_dot_" + flags[1].lstrip("-")
    other = KernelLibrary(cbuild.build_library(name, sources, flag_sets=[flags]))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6)) * 4
    for fmt in (Q8_0, Q8_K):
        out = torch.empty_like(quant_gemm.quantize_activations(x, fmt))
        assert other.entry("quant_activations_f32")(x.data_ptr(), fmt, out.data_ptr(), 3, 512) == 0
        assert torch.equal(out, quant_gemm.quantize_activations(x, fmt))
    for qtype in TYPES:
        blocks = random_blocks(qtype, 37, 512, seed=int(qtype))
        weight, got = torch.from_numpy(blocks), torch.empty(3, 37)
        args = (x.data_ptr(), weight.data_ptr(), int(qtype), None, got.data_ptr(), 3, 512, 37, 37)
        assert other.entry("quant_linear_q8_f32")(*args) == 0
        scheme, bound = _scheme_and_bound(x, blocks, qtype)
        assert ((got.double() - scheme).abs() <= bound).all(), qtype.name
        if "-mavx2" in flags:
            native = quant_gemm.quant_linear(x, weight, int(qtype), None, torch.empty(3, 37), q8=True)
            assert torch.equal(got, native), qtype.name
