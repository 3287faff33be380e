"""The Triton kernels on GGUF blocks (``pagedkv.kernels.triton_quant``) against gguf-py:
dequantization bit for bit, products to float32 rounding of the float64 product of gguf-py's
weights. On the CPU they run in Triton's interpreter (small shapes); with
``PAGEDKV_TEST_DEVICE=cuda`` (``benchmarks/gpu_check.sh``) compiled, and ``QuantizedLinear``
routes its product to them."""

from __future__ import annotations

import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from pagedkv.kernels import triton_quant
from pagedkv.models.quantized import QuantizedLinear
from tests.devices import TEST_DEVICE
from tests.quant_blocks import K_TYPES, TYPES, random_blocks

DEVICE = torch.device(TEST_DEVICE)
ROWS = (1, 3, 20)  # the decode path (up to GEMV_ROWS rows) and the tl.dot path


def _weight(qtype, out_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of ``qtype`` on DEVICE, and gguf-py's float32 dequantization of them."""
    blocks = random_blocks(qtype, out_features, 512 if qtype in K_TYPES else 160, seed)
    return torch.from_numpy(blocks).to(DEVICE), torch.from_numpy(gguf_dequantize(blocks, qtype))


def _within_rounding(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, relative: float) -> bool:
    """``got`` is the float64 ``x @ dense.T`` to float32 sums in any order, then a rounding
    of ``relative`` size."""
    exact = x.double() @ dense.double().T
    bound = x.shape[1] * 2.0**-23 * (x.double().abs() @ dense.double().abs().T) + exact.abs() * relative
    return bool(((got.double().cpu() - exact).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantization_equals_gguf_bit_for_bit(qtype):
    blocks, reference = _weight(qtype, 19, seed=int(qtype))
    got = triton_quant.dequantize(blocks, int(qtype), reference.shape[1]).cpu()
    assert torch.equal(got.view(torch.int32), reference.view(torch.int32))
    as_bf16 = triton_quant.dequantize(blocks, int(qtype), reference.shape[1], torch.bfloat16).cpu()
    assert torch.equal(as_bf16.view(torch.int16), reference.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_float32_product_is_gguf_s_dense_one_to_rounding(qtype, rows):
    blocks, dense = _weight(qtype, 19, seed=rows)
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    out = torch.empty(rows, 19, device=DEVICE)
    got = triton_quant.quant_linear(x.to(DEVICE), blocks, int(qtype), None, out)
    assert _within_rounding(got, x, dense, 2.0**-23)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", ROWS)
def test_half_activations_sum_in_float32_and_round_once(dtype, rows):
    """Decode rows multiply the exact weight; tl.dot rows the weight rounded to their dtype (as
    ``F.linear`` on the dequantized weight in that dtype): both summed in float32, rounded once."""
    qtype = K_TYPES[0]
    blocks, dense = _weight(qtype, 19, seed=40 + rows)
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(19, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = torch.empty(rows, 19, dtype=dtype, device=DEVICE)
    got = triton_quant.quant_linear(x.to(DEVICE), blocks, int(qtype), bias.to(DEVICE), out)
    weight = dense if rows <= triton_quant.GEMV_ROWS else dense.to(dtype).float()
    ones = torch.ones(rows, 1, dtype=torch.float64)  # the bias as one more column of the product
    assert _within_rounding(
        got, torch.cat([x.double(), ones], 1), torch.cat([weight, bias.float()[:, None]], 1), 2.0**-8
    )


@pytest.mark.parametrize("rows", [2, 20])
def test_a_part_writes_only_its_columns_of_a_wider_output(rows):
    blocks, dense = _weight(TYPES[0], 21, seed=7)
    x = torch.randn(rows, dense.shape[1], device=DEVICE)
    wide = torch.full((rows, 50), 7.0, device=DEVICE)
    triton_quant.quant_linear(x, blocks, int(TYPES[0]), None, wide[:, 10:31])
    alone = triton_quant.quant_linear(x, blocks, int(TYPES[0]), None, torch.empty(rows, 21, device=DEVICE))
    assert torch.equal(wide[:, 10:31], alone)
    assert (wide[:, :10] == 7.0).all() and (wide[:, 31:] == 7.0).all()


def test_bad_arguments_are_refused_by_name():
    blocks, _ = _weight(TYPES[0], 4, seed=1)
    x = torch.zeros(1, 160, device=DEVICE)
    with pytest.raises(ValueError, match="bytes are not"):
        triton_quant.quant_linear(x, blocks, int(TYPES[0]), None, torch.empty(1, 5, device=DEVICE))
    with pytest.raises(ValueError, match="activations of"):
        ints = torch.zeros(1, 160, dtype=torch.int32, device=DEVICE)
        triton_quant.quant_linear(ints, blocks, int(TYPES[0]), None, torch.empty(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 256"):
        triton_quant.dequantize(blocks, int(K_TYPES[0]), 160)


def test_a_quantized_layer_multiplies_on_its_device():
    """A :class:`QuantizedLinear` of mixed parts (Q4_K and Q6_K) on DEVICE: on CUDA its product
    is the Triton kernel's, part by part; anywhere, gguf-py's dense product to rounding."""
    parts = [_weight(K_TYPES[0], 24, seed=1), _weight(K_TYPES[2], 8, seed=2)]
    layer = QuantizedLinear([(parts[0][0], int(K_TYPES[0])), (parts[1][0], int(K_TYPES[2]))], 512)
    x = torch.randn(3, 512, device=DEVICE)
    got = layer(x)
    assert (layer.kernel(x) is triton_quant) == (DEVICE.type == "cuda")
    assert _within_rounding(got, x.cpu(), torch.cat([dense for _, dense in parts]), 2.0**-23)
