"""pagedkv's kernels: the CPU kernels in C, and the Triton kernels for CUDA.

- ``csrc/``: the C sources and their headers, compiled together into one shared library on
  first use for the machine at hand (:mod:`.library`; see :mod:`pagedkv.cbuild` for the cache):
  ``kernels.h`` (every entry point's prototype), ``simd.h`` (the vector API, for the instruction
  set it picks: ``simd_avx512.h``, ``simd_avx2.h`` or ``simd_portable.h``), each source's
  per-dtype functions as plain C in a ``*_body.h`` it includes once per dtype, and the tiled
  GEMM's loops, one ``gemm_*.h`` per instruction set.
- :mod:`.signatures`: the entry points Python calls, as ctypes sees them, declared once.
- :mod:`.library`: the one loader; :class:`~.library.KernelsUnavailable` says why the library
  cannot run here (no C compiler...), and each caller then falls back to torch.
- :mod:`.tiled_gemm`: the tiled layout of linear weights and the GEMM on it.
- :mod:`.quant_gemm`: products and dequantization of weights kept in GGUF's quantized blocks
  (``csrc/quant_types.h``, ``csrc/quant_gemm.c``), and the same products in llama.cpp's 8-bit
  arithmetic (``csrc/quant_dot.c``).
- :mod:`.paged_attention`: the CPU paged-attention entry points, by dtype.
- :mod:`.triton_attention`: the Triton paged-attention kernel (imports triton).
- :mod:`.triton_quant` (with :mod:`.triton_quant_blocks`): products and dequantization of GGUF
  blocks on CUDA; :mod:`.triton_lora`: the LoRA BGMV on CUDA (both import triton).
- :mod:`.triton_launch`: how every Triton kernel is launched, compiled or interpreted.

The fused layer ops (``layer_ops.c``) and the decode stack (``decode_stack.c``) are called from
:mod:`pagedkv.models.layer_ops` and :mod:`pagedkv.models.decode_stack`, which decide when a
model's layers can take them. This package imports nothing else of pagedkv but
:mod:`pagedkv.cbuild`: ``attention/`` and ``models/`` sit above it. This module itself imports
only the standard library (a Triton module at its first :func:`triton_kernels` call), so the
names below are free to read from the command line.
"""

import functools
import importlib
import importlib.util
from types import ModuleType

#: The GEMM kernels a linear layer can run on (``EngineConfig.linear_kernel``,
#: ``--linear-kernel``): auto (the first of tiled, onednn, torch that runs the model's device and
#: dtype), tiled (pagedkv's, :mod:`.tiled_gemm`), onednn (oneDNN on packed weights) or torch
#: (``F.linear``).
LINEAR_KERNELS: tuple[str, ...] = ("auto", "tiled", "onednn", "torch")

#: The arithmetic of products with GGUF-block weights (``EngineConfig.quantized_activations``,
#: ``--quantized-activations``): float (the activations as they are, the weights exactly as
#: dequantized, float32 sums); q8 (a product of a few rows -- a small decode step -- rounds each
#: activation row to 8-bit blocks and sums integer products, llama.cpp's arithmetic, where it is
#: the faster; more rows stay float); q8-all (every product in llama.cpp's arithmetic, prefill
#: too: what llama.cpp computes, for comparing with it). See :mod:`.quant_gemm`.
QUANTIZED_ACTIVATIONS: tuple[str, ...] = ("float", "q8", "q8-all")


@functools.cache
def triton_kernels(name: str) -> ModuleType | None:
    """The module ``pagedkv.kernels.<name>`` of Triton kernels, or None where triton is not
    installed (its callers then run torch). Imported at the first call, not before."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module(f"{__name__}.{name}")
