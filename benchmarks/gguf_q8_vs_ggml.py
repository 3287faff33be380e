"""pagedkv's "q8" products against ggml's own: for each GGUF block type, random weight rows and
one activation row, the activation blocks of ggml's ``from_float`` (its type traits' vec_dot
type) against pagedkv's, and ggml's ``vec_dot`` against ``quant_linear(..., q8=True)``, relative
to the largest output; the float product's distance beside it for scale. Reads ggml from a
llama.cpp build (llama-cpp-python's wheel ships ``libggml-base.so`` and ``libggml-cpu.so``):

  PYTHONPATH=. .venv/bin/python benchmarks/gguf_q8_vs_ggml.py \\
      $RIVALS/llamacpp/lib/python3.11/site-packages/llama_cpp/lib
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from pagedkv.kernels import quant_gemm
from tests.quant_blocks import TYPES, random_blocks

#: ggml's activation block types: bytes per block (Q8_0, Q8_1, Q8_K)
ACTIVATION_BYTES = {8: 34, 9: 36, 15: 292}
FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(
    None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
)  # fmt: skip


class TypeTraits(ctypes.Structure):
    """ggml-cpu.h's ``struct ggml_type_traits_cpu``."""

    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


def main(folder: str, in_features: int = 1536, rows: int = 40) -> None:
    ctypes.CDLL(f"{folder}/libggml-base.so", mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(f"{folder}/libggml-cpu.so", mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraits)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, in_features)).astype(np.float32))
    for qtype in TYPES:
        traits = cpu.ggml_get_type_traits_cpu(int(qtype)).contents
        kind = traits.vec_dot_type
        elements = 256 if kind == 15 else 32
        theirs = np.zeros(in_features // elements * ACTIVATION_BYTES[kind], np.uint8)
        FROM_FLOAT(cpu.ggml_get_type_traits_cpu(kind).contents.from_float)(
            x.numpy().ctypes.data, theirs.ctypes.data, in_features
        )
        ours, compared = quant_gemm.quantize_activations(x, 15 if kind == 15 else 8).numpy()[0], theirs
        if kind == 9:  # Q8_1 keeps d, then d * sum as a half, then the quants; ours Q8_0: d, quants
            compared, ours = theirs.reshape(-1, 36)[:, [0, 1, *range(4, 36)]], ours.reshape(-1, 34)
        blocks = random_blocks(qtype, rows, in_features, seed=3)
        reference, result = np.zeros(rows, np.float32), ctypes.c_float()
        dot = VEC_DOT(traits.vec_dot)
        for n in range(rows):
            dot(in_features, ctypes.byref(result), 0, blocks[n].ctypes.data, 0, theirs.ctypes.data, 0, 1)
            reference[n] = result.value
        weight = torch.from_numpy(blocks)
        q8 = quant_gemm.quant_linear(x, weight, int(qtype), None, torch.empty(1, rows), q8=True)[0].numpy()
        exact = quant_gemm.quant_linear(x, weight, int(qtype), None, torch.empty(1, rows))[0].numpy()
        size = np.abs(reference).max()
        print(
            f"{qtype.name}: activations equal {np.array_equal(compared, ours)}; "
            f"q8 vs ggml {np.abs(q8 - reference).max() / size:.1e}, float vs ggml "
            f"{np.abs(exact - reference).max() / size:.1e}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
