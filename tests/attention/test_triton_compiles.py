"""The Triton kernels compile for a GPU, here, without one.

The rest of the suite runs them in Triton's interpreter, which accepts some code the compiler
refuses (and the reverse); compiling them ahead of time for a Hopper target (sm_90, with the
ptxas that ships inside triton's wheel) catches that on every machine, before a GPU run does.
"""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedkv.kernels import triton_attention

HOPPER = GPUTarget("cuda", 90, 32)

ATTENTION_ARGS = {
    **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "k_scale_ptr", "v_scale_ptr"), "*bf16"),
    **dict.fromkeys(("out_ptr", "max_ptr", "sum_ptr"), "*fp32"),
    **dict.fromkeys(("block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr"), "*i32"),
    "scale": "fp32",
    "soft_cap": "fp32",
    **dict.fromkeys(("window", "num_splits", "stride_qt", "stride_qh", "stride_kb", "stride_ks"), "i32"),
    **dict.fromkeys(("stride_kh", "stride_table", "num_tokens"), "i32"),
}
ATTENTION_SHAPE = dict(
    GROUP=4, NUM_HEADS=32, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_M=4, BLOCK_G=4, BLOCK_N=64, BLOCK_D=64
)


def _compile(kernel, signature: dict, constexprs: dict) -> bytes:
    signature = signature | dict.fromkeys(constexprs, "constexpr")
    source = ASTSource(triton.jit(kernel), signature=signature, constexprs=constexprs)
    return triton.compile(source, target=HOPPER).asm["cubin"]


@pytest.mark.parametrize(
    ("split", "window", "soft_cap"),
    [(True, False, False), (False, False, False), (True, True, True), (False, True, False)],
)
def test_the_paged_attention_kernel_compiles_split_or_whole(split, window, soft_cap):
    flags = dict(
        USE_WINDOW=window, USE_SOFT_CAP=soft_cap, DOT_FP32=False, SPLIT=split, QUANT=False, FP8=False
    )
    signature = ATTENTION_ARGS | {"out_ptr": "*fp32" if split else "*bf16"}
    assert _compile(triton_attention.paged_attention_kernel, signature, ATTENTION_SHAPE | flags)


@pytest.mark.parametrize(("out", "dim"), [("*bf16", 64), ("*fp32", 128), ("*fp16", 80)])
def test_the_merge_kernel_compiles(out, dim):
    signature = dict.fromkeys(("acc_ptr", "max_ptr", "sum_ptr"), "*fp32") | {"out_ptr": out}
    signature |= {"num_splits": "i32", "num_rows": "i32"}
    block_d = 1 << (dim - 1).bit_length()
    assert _compile(
        triton_attention.merge_splits_kernel, signature, dict(HEAD_DIM=dim, BLOCK_S=16, BLOCK_D=block_d)
    )
