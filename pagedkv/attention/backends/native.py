"""Build and load the C paged-attention kernel for the CPU (``csrc/paged_attention_cpu.c``).

The kernel reads keys and values in place from the block pool, which no composition of torch
operators can do without first copying every context (see ``benchmarks/attention.py`` for the
numbers). It is plain C with OpenMP, built and cached by :mod:`pagedkv.cbuild` and called
through :mod:`ctypes`. When it cannot be built, :func:`load` returns a string saying why.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedkv import cbuild

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
SUFFIXES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
#: quantized pool element types: entry ``paged_attention_rows_<query suffix>_<this>``
POOL_SUFFIXES = {torch.float8_e4m3fn: "fp8", torch.int8: "i8"}
MAX_GROUP = 64  # the kernel's limit on query heads per KV head is its stack arrays; see the source

_ARGTYPES = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64, ctypes.c_float]
_ARGTYPES += [ctypes.c_int64, ctypes.c_int]
_PREFILL_ARGTYPES = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]


class NativeKernel:
    """The compiled library; ``fn(dtype, pool_dtype)`` is the entry point for a query in ``dtype``
    over pools of ``pool_dtype`` (the same dtype, or a quantized one with scales)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.functions = {}
        self.prefill_functions = {}
        for dtype, suffix in SUFFIXES.items():
            pools = {dtype: suffix} | {pool: f"{suffix}_{name}" for pool, name in POOL_SUFFIXES.items()}
            for pool, name in pools.items():
                entry = f"paged_attention_rows_{name}"
                if hasattr(self.lib, entry):  # float16 is missing from builds without _Float16
                    fn = getattr(self.lib, entry)
                    fn.restype = ctypes.c_int
                    fn.argtypes = _ARGTYPES
                    self.functions[dtype, pool] = fn
            entry = f"paged_attention_prefill_{suffix}"
            if hasattr(self.lib, entry):
                fn = getattr(self.lib, entry)
                fn.restype = ctypes.c_int
                fn.argtypes = _PREFILL_ARGTYPES
                self.prefill_functions[dtype] = fn
        #: query rows x query heads of one prefill tile (0: a build without prefill tiles)
        self.prefill_lanes = 0
        if hasattr(self.lib, "paged_attention_prefill_lanes"):
            self.lib.paged_attention_prefill_lanes.restype = ctypes.c_int64
            self.prefill_lanes = int(self.lib.paged_attention_prefill_lanes())

    def fn(self, dtype: torch.dtype, pool_dtype: torch.dtype | None = None):
        """The entry point for these dtypes (``pool_dtype`` defaults to ``dtype``), or ``None``
        when this build lacks it."""
        return self.functions.get((dtype, pool_dtype or dtype))

    def prefill_fn(self, dtype: torch.dtype):
        """The prefill-tile entry point for queries and pools in ``dtype``, or ``None``."""
        return self.prefill_functions.get(dtype)


@functools.cache
def load() -> NativeKernel | str:
    """The kernel, or a string saying why it could not be built."""
    built = cbuild.build(SOURCE)
    if isinstance(built, str):
        return built
    try:
        return NativeKernel(built)
    except OSError as exc:  # a cached file this machine cannot load
        return f"could not load {built}: {exc}"
