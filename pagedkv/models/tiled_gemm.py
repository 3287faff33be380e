"""pagedkv's own float32 GEMM for the CPU linear layers, on weights stored in column tiles.

A decode step reads every weight from DRAM once for a few rows; oneDNN's packed sgemm streams
them at 13-28 GB/s of the ~42 GB/s two cores of this host read, so a step of small batches
waits on memory it could have had. ``csrc/tiled_gemm_cpu.c`` stores each run of 64 output
columns as one contiguous tile that its k loop reads front to back, reusing it from L2 for every
block of 6 rows. On issue 12's model, all of a step's weights in a row (cold, 2 threads), it ran
1.15-1.5x oneDNN's rate from 1 to 64 rows, and within 5 % of oneDNN at prefill's 2048.

The tiled weight is a flat float32 tensor of exactly ``out * in`` elements (see the C source for
the layout): a 1-D weight is how :func:`pagedkv.models.linear.linear` knows it, and ``in`` comes
from the input's last dimension. Built and loaded like the other CPU kernels
(:mod:`pagedkv.cbuild`); every sum runs over k in order, so a row's output does not depend on
how many rows share its call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedkv import cbuild

SOURCE = Path(__file__).parent / "csrc" / "tiled_gemm_cpu.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | str:
    built = cbuild.build(SOURCE)
    if isinstance(built, str):
        return built
    try:
        lib = ctypes.CDLL(str(built))
    except OSError as exc:  # a cached file this machine cannot load
        return f"could not load {built}: {exc}"
    lib.tiled_linear_f32.restype = None
    lib.tiled_linear_f32.argtypes = [_P, _P, _P, _P, _I, _I, _I]
    lib.tiled_gemm_tile_width.restype = _I
    return lib


def why_unavailable() -> str | None:
    """Why the tiled kernel cannot run here, or None when it can."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def tile_width() -> int:
    """Output columns per tile, as compiled."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return lib.tiled_gemm_tile_width()


def to_tiles(weight: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` float32 ``weight`` in the tiled layout: a new flat tensor, same size."""
    out_features, in_features = weight.shape
    width = tile_width()
    full = out_features // width * width
    head = weight[:full].reshape(-1, width, in_features).transpose(1, 2).reshape(-1)
    tail = weight[full:].t().reshape(-1)  # the last, narrower tile: its k rows are `rest` wide
    return torch.cat([head, tail]).contiguous()


def from_tiles(tiles: torch.Tensor, in_features: int) -> torch.Tensor:
    """The plain ``[out, in]`` matrix back from :func:`to_tiles`'s layout (a copy)."""
    out_features = tiles.numel() // in_features
    width = tile_width()
    full = out_features // width * width
    head = tiles[: full * in_features].view(-1, in_features, width).transpose(1, 2).reshape(full, in_features)
    tail = tiles[full * in_features :].view(in_features, out_features - full).t()
    return torch.cat([head, tail]).contiguous()


def tiled_linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for the tiled float32 weight ``tiles`` of ``W``."""
    lib = _library()
    in_features = x.shape[-1]
    out_features = tiles.numel() // in_features
    rows = x.reshape(-1, in_features).contiguous()
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    if rows.shape[0]:
        lib.tiled_linear_f32(
            rows.data_ptr(),
            tiles.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            in_features,
            out_features,
        )
    return out.view(*x.shape[:-1], out_features)
