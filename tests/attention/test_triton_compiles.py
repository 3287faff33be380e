"""The Triton kernels compile for a GPU, here, without one.

The rest of the suite runs them in Triton's interpreter, which accepts some code the compiler
refuses (and the reverse); compiling them ahead of time for a Hopper target (sm_90, with the
ptxas that ships inside triton's wheel) catches that on every machine, before a GPU run does.
The compiler runs in a process of its own: once the interpreter has run in a process, it has
patched ``triton.language`` there for good.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ATTENTION_VARIANTS = {  # name -> (SPLIT, USE_WINDOW, USE_SOFT_CAP)
    "split": (True, False, False),
    "whole": (False, False, False),
    "split-window-softcap": (True, True, True),
    "whole-window": (False, True, False),
}
MERGE_VARIANTS = {
    "merge-bf16-64": ("*bf16", 64),
    "merge-fp32-128": ("*fp32", 128),
    "merge-fp16-80": ("*fp16", 80),
}


def compile_all() -> dict[str, str]:
    """Compile every variant for sm_90; ``name -> "ok"`` or the compiler's message."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedkv.kernels import triton_attention

    def compile_one(kernel, signature: dict, constexprs: dict) -> str:
        signature = signature | dict.fromkeys(constexprs, "constexpr")
        source = ASTSource(triton.jit(kernel), signature=signature, constexprs=constexprs)
        try:
            cubin = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
        except Exception as err:  # the message is the result
            return f"{type(err).__name__}: {err}"
        return "ok" if cubin else "empty cubin"

    attention_args = {
        **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "k_scale_ptr", "v_scale_ptr"), "*bf16"),
        **dict.fromkeys(("out_ptr", "max_ptr", "sum_ptr"), "*fp32"),
        **dict.fromkeys(("block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr"), "*i32"),
        "scale": "fp32",
        "soft_cap": "fp32",
        **dict.fromkeys(("window", "num_splits", "stride_qt", "stride_qh", "stride_kb", "stride_ks"), "i32"),
        **dict.fromkeys(("stride_kh", "stride_table", "num_tokens"), "i32"),
    }
    shape = dict(
        GROUP=4, NUM_HEADS=32, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_M=4, BLOCK_G=4, BLOCK_N=64, BLOCK_D=64
    )
    results = {}
    for name, (split, window, cap) in ATTENTION_VARIANTS.items():
        flags = dict(USE_WINDOW=window, USE_SOFT_CAP=cap, DOT_FP32=False, SPLIT=split, QUANT=False, FP8=False)
        signature = attention_args | {"out_ptr": "*fp32" if split else "*bf16"}
        results[name] = compile_one(triton_attention.paged_attention_kernel, signature, shape | flags)
    for name, (out, dim) in MERGE_VARIANTS.items():
        signature = dict.fromkeys(("acc_ptr", "max_ptr", "sum_ptr"), "*fp32") | {"out_ptr": out}
        signature |= {"num_splits": "i32", "num_rows": "i32"}
        constexprs = dict(HEAD_DIM=dim, BLOCK_S=16, BLOCK_D=1 << (dim - 1).bit_length())
        results[name] = compile_one(triton_attention.merge_splits_kernel, signature, constexprs)
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.attention.test_triton_compiles"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", [*ATTENTION_VARIANTS, *MERGE_VARIANTS])
def test_the_kernel_compiles_for_a_hopper_gpu(compiled, variant):
    assert compiled[variant] == "ok"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
