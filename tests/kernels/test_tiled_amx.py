"""The tiled GEMM's bfloat16 product on AMX tiles (csrc/gemm_amx.h) where the CPU has them, else
its AVX512-BF16 or AVX2 loop: every batch size and tile shape to bfloat16 rounding of the exact
product, a row's bits independent of its batch, and the switch that keeps AMX off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.kernels import tiled_gemm
from pagedkv.kernels.tiled_gemm import tiled_gate_up, tiled_linear, to_paired_tiles, to_tiles
from pagedkv.models.layer_ops import native_ops

BF16_TILES = tiled_gemm.why_unavailable(torch.bfloat16) is None


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


def _bound(x: torch.Tensor, weight: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """float32 sums of ``x @ weight.T`` in any order, then one rounding to bfloat16."""
    k = x.shape[1]
    return k * 2.0**-23 * (x.double().abs() @ weight.double().abs().T) + exact.abs() * 2.0**-8 + 1e-30


def test_amx_runs_where_the_cpu_has_it():
    """AMX only on a CPU whose flags name its tiles and bfloat16 multiplies, from one row."""
    if not BF16_TILES:
        with pytest.raises(ValueError, match="'tiled' cannot run here"):
            from pagedkv.models.linear import choose_linear_kernel

            choose_linear_kernel("tiled", torch.device("cpu"), torch.bfloat16)
        return
    rows = tiled_gemm.amx_rows()
    if not {"amx_tile", "amx_bf16"} <= _cpu_flags() or tiled_gemm.bf16_loop() != tiled_gemm.BF16_DOT:
        assert rows == 0
    assert rows in (0, 1)


# full and narrow tiles (N % 64), K a whole number of 32-k blocks or not, odd K (a zero pair)
SHAPES = [(128, 64), (200, 47), (7, 33), (64, 1100), (192, 576)]


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_every_batch_is_the_exact_product_rounded_and_a_row_keeps_its_bits(out_features, in_features):
    if not BF16_TILES:
        assert tiled_gemm.amx_rows() == 0
        return
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    tiles = to_tiles(weight)
    x = torch.randn(70, in_features, generator=gen).bfloat16()
    alone = torch.cat([tiled_linear(x[m : m + 1], tiles, bias) for m in range(70)])
    for rows in (1, 2, 15, 16, 17, 33, 70):
        got = tiled_linear(x[:rows], tiles, bias)
        assert torch.equal(got, alone[:rows])  # 1, 2 and 4 row blocks of 16; 1 and 2 halves
    exact = x.double() @ weight.double().T + bias.double()
    assert ((alone.double() - exact).abs() <= _bound(x, weight, exact)).all()


@pytest.mark.parametrize("intermediate", [128, 200])
def test_the_gate_up_pairs_equal_the_plain_product_then_the_activation(intermediate):
    if not BF16_TILES:
        assert tiled_gemm.amx_rows() == 0
        return
    gen = torch.Generator().manual_seed(intermediate)
    weight = torch.randn(2 * intermediate, 96, generator=gen).bfloat16()
    x = torch.randn(40, 96, generator=gen).bfloat16()
    paired, plain = to_paired_tiles(weight), tiled_linear(x, to_tiles(weight), None)
    assert torch.equal(tiled_gate_up(x, paired, False), plain)
    assert torch.equal(tiled_gate_up(x, paired, True), native_ops(torch.bfloat16).silu_and_mul(plain))


def _pairwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vdpbf16ps' sums written out: k in pairs (odd ``in``: the last with zero), each pair's odd
    product added before its even one, in float32; one rounding to bfloat16."""
    x, weight = x.float(), weight.float()
    if x.shape[1] % 2:
        x, weight = torch.nn.functional.pad(x, (0, 1)), torch.nn.functional.pad(weight, (0, 1))
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for p in range(x.shape[1] // 2):
        acc = acc + x[:, 2 * p + 1, None] * weight[None, :, 2 * p + 1]
        acc = acc + x[:, 2 * p, None] * weight[None, :, 2 * p]
    return acc.bfloat16()


def test_the_environment_switch_keeps_amx_off_and_the_dot_products_sum_pairs(tmp_path):
    """``PAGEDKV_TILED_AMX=0`` (read once, so in a new process): no AMX, and a batch runs on the
    AVX512-BF16 or AVX2 loop, whose sums are vdpbf16ps' (the AMX path's differ in rare last bits)."""
    code = (
        "import sys, torch; from pagedkv.kernels import tiled_gemm as t\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = torch.randn(200, 47, generator=g).bfloat16(); x = torch.randn(9, 47, generator=g).bfloat16()\n"
        "ok = t.why_unavailable(torch.bfloat16) is None\n"
        "y = t.tiled_linear(x, t.to_tiles(w), None) if ok else None\n"
        "torch.save((t.amx_rows(), w, x, y), sys.argv[1])"
    )
    env = dict(os.environ, PAGEDKV_TILED_AMX="0")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "out.pt")], env=env, check=True)
    rows, weight, x, got = torch.load(tmp_path / "out.pt")
    assert rows == 0
    if got is not None:
        assert torch.equal(got, _pairwise(x, weight))
