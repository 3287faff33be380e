"""How pagedkv launches its Triton kernels: jitted for a GPU, or in Triton's interpreter for CPU
tensors (the test suite's way of running the very same kernel code without a GPU).

A kernel is a plain function of its module, decorated at first use (:func:`jitted`): for CUDA
tensors with ``triton.jit``, for CPU tensors with Triton's interpreter (what
``TRITON_INTERPRET=1`` does), whatever the environment said when triton was imported. Helpers a
kernel calls are ``@triton.jit`` functions; :func:`interpreted_device_calls` routes their calls
through the interpreter during an interpreted launch. :func:`launch` does both for one call.

Kernels store a float32 result in a narrower dtype with :func:`to_storage`: round to nearest
even, as torch's ``.to`` rounds, compiled or interpreted (the interpreter's own bfloat16
conversion truncates).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def to_storage(x, dtype: tl.constexpr):
    """Float32 ``x`` as ``dtype``, rounded to nearest even. For bfloat16 the rounding is made
    on the bits (the value then converts exactly), for the other dtypes by the conversion."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


_compiled: dict[tuple[str, str, bool], object] = {}


def jitted(kernel: Callable, interpret: bool):
    """``kernel`` (a plain function), jitted for a GPU or wrapped in Triton's CPU interpreter;
    made once per kernel and mode."""
    key = (kernel.__module__, kernel.__name__, interpret)
    if key not in _compiled:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            _compiled[key] = InterpretedFunction(kernel)
        else:
            _compiled[key] = triton.jit(kernel)
    return _compiled[key]


@contextlib.contextmanager
def interpreted_device_calls():
    """Let an interpreted kernel call ``@triton.jit`` helpers (``tl.max``, ``tl.sum``, a
    module's own). Triton decides at import time whether those helpers are compiled or
    interpreted (``TRITON_INTERPRET``); when triton was imported without it, this routes their
    calls through the interpreter for the duration of one launch, which is what importing
    under ``TRITON_INTERPRET=1`` would have done. A no-op when they are interpreted already."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__
    wrapped: dict[int, InterpretedFunction] = {}

    def call(self, *args, **kwargs):
        if id(self) not in wrapped:
            wrapped[id(self)] = InterpretedFunction(self.fn)
        return wrapped[id(self)](*args, **kwargs)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original


def launch(kernel: Callable, grid: Sequence[int], device: torch.device, *args, **kwargs) -> None:
    """One launch of ``kernel`` over ``grid`` for tensors on ``device``: compiled on CUDA,
    interpreted anywhere else."""
    interpret = device.type != "cuda"
    scope = interpreted_device_calls() if interpret else contextlib.nullcontext()
    with scope:
        jitted(kernel, interpret)[tuple(grid)](*args, **kwargs)
