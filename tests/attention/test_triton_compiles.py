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
#: the GGUF product: decode rows (no tl.dot) on every type, batches (tl.dot) on a legacy type and
#: each super-block layout, in bfloat16, float32 (ieee tl.dot) and float16
QUANT_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
QUANT_VARIANTS = {  # name -> (qtype, rows, activation dtype)
    **{f"quant-{name}-gemv-bf16": (qtype, 1, "bf16") for name, qtype in QUANT_TYPES.items()},
    "quant-q4_0-dot-bf16": (2, 40, "bf16"),
    "quant-q4_k-dot-fp32": (12, 40, "fp32"),
    "quant-q6_k-dot-fp16": (14, 17, "fp16"),
    "quant-q8_0-gemv4-fp16": (8, 4, "fp16"),
}
DEQUANTIZE_VARIANTS = {"dequantize-q4_0-bf16": (2, "bf16"), "dequantize-q6_k-fp32": (14, "fp32")}
LORA_VARIANTS = {"lora-bf16": "bf16", "lora-fp32": "fp32"}


def compile_all() -> dict[str, str]:
    """Compile every variant for sm_90; ``name -> "ok"`` or the compiler's message."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedkv.kernels import triton_attention, triton_lora, triton_quant

    def compile_one(kernel, signature: dict, constexprs: dict, num_warps: int = 4) -> str:
        signature = signature | dict.fromkeys(constexprs, "constexpr")
        source = ASTSource(triton.jit(kernel), signature=signature, constexprs=constexprs)
        try:
            options = {"num_warps": num_warps}
            cubin = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]
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
    sizes = dict.fromkeys(("num_rows", "N", "K", "stride_x", "stride_out", "stride_w"), "i32")
    for name, (qtype, rows, dtype) in QUANT_VARIANTS.items():
        tile = triton_quant.tiles(qtype, rows)
        warps = tile.pop("num_warps")
        signature = dict.fromkeys(("x_ptr", "bias_ptr", "out_ptr"), f"*{dtype}") | {"w_ptr": "*u8"} | sizes
        constexprs = tile | dict(DOT_IEEE=dtype == "fp32", HAS_BIAS=True)
        results[name] = compile_one(triton_quant.quant_matmul_kernel, signature, constexprs, warps)
    for name, (qtype, dtype) in DEQUANTIZE_VARIANTS.items():
        tile = triton_quant.tiles(qtype, 1)
        constexprs = {key: tile[key] for key in ("QTYPE", "BLOCK_ELEMENTS", "BLOCK_BYTES", "SUB", "SUB_LEN")}
        signature = {"w_ptr": "*u8", "out_ptr": f"*{dtype}", "N": "i32", "K": "i32", "stride_w": "i32"}
        results[name] = compile_one(triton_quant.dequantize_kernel, signature, constexprs | dict(BLOCK_N=16))
    for name, dtype in LORA_VARIANTS.items():
        counts = dict.fromkeys(("n_in", "rank", "rows_per_slot", "stride_x"), "i32")
        signature = {
            "x_ptr": f"*{dtype}",
            "a_ptr": f"*{dtype}",
            "row_slot_ptr": "*i32",
            "scaling_ptr": "*fp32",
        }
        signature |= {"low_ptr": "*fp32"} | counts
        shrink = compile_one(triton_lora.lora_shrink_kernel, signature, dict(BLOCK_R=16, BLOCK_K=256))
        counts = dict.fromkeys(("n_out", "rank", "rows_per_slot", "shards", "stride_out"), "i32")
        signature = {"low_ptr": "*fp32", "b_ptr": f"*{dtype}", "row_slot_ptr": "*i32", "columns_ptr": "*i64"}
        signature |= {"out_ptr": f"*{dtype}"} | counts
        expand = compile_one(
            triton_lora.lora_expand_kernel, signature, dict(BLOCK_N=128, BLOCK_R=16, BLOCK_S=2)
        )
        results[name] = shrink if shrink != "ok" else expand
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


VARIANTS = [*ATTENTION_VARIANTS, *MERGE_VARIANTS, *QUANT_VARIANTS, *DEQUANTIZE_VARIANTS, *LORA_VARIANTS]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_kernel_compiles_for_a_hopper_gpu(compiled, variant):
    assert compiled[variant] == "ok"


if __name__ == "__main__":
    print(json.dumps(compile_all()))
