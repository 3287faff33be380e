"""pagedkv's own GEMM for the CPU linear layers (float32 and bfloat16), on weights stored in
column tiles.

A decode step reads every weight from DRAM once for a few rows; oneDNN's packed GEMM streams
them at 13-28 GB/s of the ~42 GB/s two cores of this host read, so a step of small batches
waits on memory it could have had. ``csrc/tiled_gemm_cpu.c`` stores each run of 64 output
columns as one contiguous tile that its k loop reads front to back, reusing it from L2 for every
block of 6 rows. On issue 12's model, all of a step's weights in a row (cold, 2 threads), it ran
1.1-1.45x oneDNN's rate from 1 to 64 rows in float32 and bfloat16, and level with it at
prefill's 2048 rows (``benchmarks/tiled_gemm_ab.py``). On an AVX2-only Zen 1 EPYC its AVX2 loop
ran 1.03-1.34x oneDNN from 1 to 64 rows and 0.94x at 2048 (README, "AVX2: a Zen 1 host").

The tiled weight is a flat tensor of the weight's dtype holding exactly its elements (bfloat16
adds a zero k row when ``in`` is odd; see the C source for the layout): a 1-D weight is how
:func:`pagedkv.models.linear.linear` knows it, and ``in`` comes from the input's last dimension.
Built and loaded like the other CPU kernels (:mod:`pagedkv.cbuild`). Every sum runs over k in
order, so a row's output does not depend on how many rows share its call. bfloat16 sums k in
pairs, each pair's odd product first, in float32: AVX512-BF16's dot products of pairs
(``vdpbf16ps``, oneDNN's instruction) where the CPU has them -- there the outputs equal
``F.linear``'s (oneDNN's) bit for bit up to 8 rows, and from 32 rows with k >= 1024 all but about
1 in 10,000, which differ in the last bit (oneDNN then sums k in another order) -- and on AVX2
the same sums with each pair widened to float32 as it is loaded (tested against the pairs
written out in torch; a product of bfloat16 values is exact in float32, so only denormals,
which vdpbf16ps flushes, can round differently). Without AVX512-BF16, oneDNN has no bfloat16 of its own
and ``F.linear`` runs torch's emulated one, 1.7-6x slower than this loop on a Zen 1 EPYC.
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
    lib = cbuild.load(SOURCE)
    if isinstance(lib, str):
        return lib
    lib.tiled_linear_f32.restype = None
    lib.tiled_linear_bf16.restype = ctypes.c_int  # 1: no memory for its workspace
    for entry in ("tiled_linear_f32", "tiled_linear_bf16"):
        getattr(lib, entry).argtypes = [_P, _P, _P, _P, _I, _I, _I]
    for entry in ("tiled_gate_up_f32", "tiled_gate_up_bf16"):
        getattr(lib, entry).restype = ctypes.c_int
        getattr(lib, entry).argtypes = [_P, _P, _P, _I, _I, _I, _P]
    lib.tiled_rows.restype = ctypes.c_int
    lib.tiled_rows.argtypes = [_P, _P, _P, _I, _I, _I, _I, _I]
    lib.tiled_gemm_tile_width.restype = _I
    lib.tiled_gemm_bf16_loop.restype = _I
    return lib


def tile_width() -> int:
    """Output columns per tile, as compiled."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return lib.tiled_gemm_tile_width()


#: k values stored side by side per column: bfloat16 runs on dot products of pairs
_GROUP = {torch.float32: 1, torch.bfloat16: 2}
_ENTRY = {torch.float32: "tiled_linear_f32", torch.bfloat16: "tiled_linear_bf16"}
_GATE_UP_ENTRY = {torch.float32: "tiled_gate_up_f32", torch.bfloat16: "tiled_gate_up_bf16"}


def runs_dtype(dtype: torch.dtype) -> str | None:
    """Why the tiled kernel cannot run ``dtype`` here, or None when it can."""
    lib = _library()
    if isinstance(lib, str):
        return lib
    if dtype not in _ENTRY:
        return f"the tiled kernel has no {str(dtype).removeprefix('torch.')}"
    if dtype == torch.bfloat16 and lib.tiled_gemm_bf16_loop() == BF16_PORTABLE:
        return "the tiled bfloat16 kernel needs AVX512-BF16, or AVX2 with FMA"
    return None


#: what :func:`bf16_loop` returns: the C source's loops for bfloat16
BF16_PORTABLE, BF16_WIDENING, BF16_DOT = 0, 1, 2


def bf16_loop() -> int:
    """Which loop runs bfloat16 here, as compiled: ``BF16_DOT`` (AVX512-BF16's dot products of
    pairs), ``BF16_WIDENING`` (AVX2: pairs widened to float32 as loaded) or ``BF16_PORTABLE``.
    The first two give the same bits (see the C source); the portable one is too slow to choose."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return lib.tiled_gemm_bf16_loop()


def entry_points(dtype: torch.dtype) -> tuple[int, int]:
    """The addresses of the linear and the gate/up entry points for ``dtype``, for C that calls
    them itself (:mod:`pagedkv.models.decode_stack`); float32's linear returns nothing, bfloat16's
    a status."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return tuple(
        ctypes.cast(getattr(lib, entry[dtype]), ctypes.c_void_p).value for entry in (_ENTRY, _GATE_UP_ENTRY)
    )


def _padded(in_features: int, dtype: torch.dtype) -> int:
    group = _GROUP[dtype]
    return -(-in_features // group) * group


def to_tiles(weight: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` ``weight`` in the tiled layout: a new flat tensor of its dtype (one zero
    k row more in bfloat16 when ``in`` is odd)."""
    out_features, in_features = weight.shape
    group, width = _GROUP[weight.dtype], tile_width()
    padded = _padded(in_features, weight.dtype)
    if padded != in_features:
        weight = torch.cat([weight, weight.new_zeros(out_features, padded - in_features)], dim=1)
    full = out_features // width * width
    head = weight[:full].reshape(-1, width, padded // group, group).permute(0, 2, 1, 3).reshape(-1)
    tail = weight[full:].reshape(-1, padded // group, group).transpose(0, 1).reshape(-1)  # narrower tile
    return torch.cat([head, tail]).contiguous()


def from_tiles(tiles: torch.Tensor, in_features: int) -> torch.Tensor:
    """The plain ``[out, in]`` matrix back from :func:`to_tiles`'s layout (a copy)."""
    group, width = _GROUP[tiles.dtype], tile_width()
    padded = _padded(in_features, tiles.dtype)
    out_features = tiles.numel() // padded
    full = out_features // width * width
    head = tiles[: full * padded].view(-1, padded // group, width, group).permute(0, 2, 1, 3)
    tail = tiles[full * padded :].view(padded // group, out_features - full, group).transpose(0, 1)
    weight = torch.cat([head.reshape(full, padded), tail.reshape(out_features - full, padded)])
    return weight[:, :in_features].contiguous()


def tiled_rows(tiles: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``W[ids]`` of the weight held in :func:`to_tiles`'s layout, ``[*ids.shape, in]``:
    an embedding lookup on a matrix the LM head shares in the tiled layout."""
    out_features = tiles.numel() // _padded(in_features, tiles.dtype)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    rows = tiles.new_empty((flat.shape[0], in_features))
    args = (flat.shape[0], in_features, out_features, tiles.element_size(), _GROUP[tiles.dtype])
    if _library().tiled_rows(tiles.data_ptr(), flat.data_ptr(), rows.data_ptr(), *args):
        raise IndexError(f"a token id is outside the vocabulary of {out_features}: {ids.tolist()}")
    return rows.view(*ids.shape, in_features)


def _output(out: torch.Tensor | None, count: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (a contiguous ``[count, width]`` tensor of ``dtype`` the caller keeps between
    steps, see :class:`pagedkv.models.linear.OutputSlot`), or a new one."""
    if out is None:
        return torch.empty((count, width), dtype=dtype)
    if out.shape != (count, width) or out.dtype != dtype or not out.is_contiguous():
        got = f"{out.dtype} {tuple(out.shape)}"
        raise ValueError(f"out must be a contiguous {dtype} [{count}, {width}], got {got}")
    return out


def tiled_linear(
    x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` for the tiled weight ``tiles`` of ``W`` (float32 or bfloat16, like ``x``),
    into ``out`` when given (2-D ``x`` only).

    A step calls this ~25 times, so a contiguous 2-D ``x`` (every call of the step program)
    skips the reshape and the view back: 7.9 -> 4.8 us a call around the C kernel."""
    in_features, dtype = x.shape[-1], tiles.dtype
    out_features = tiles.numel() // _padded(in_features, dtype)
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, in_features).contiguous()
    count = rows.shape[0]
    out = _output(out, count, out_features, dtype)
    if count:
        failed = getattr(_library(), _ENTRY[dtype])(
            rows.data_ptr(),
            tiles.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            count,
            in_features,
            out_features,
        )
        if failed:  # None for float32, which needs no workspace
            raise MemoryError("the tiled bfloat16 kernel could not allocate its workspace")
    return out if flat else out.view(*x.shape[:-1], out_features)


def _pair_runs(weight: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The gate and up row blocks of each run of a tile's width (the last one narrower)."""
    half, width = weight.shape[0] // 2, tile_width()
    gate, up = weight[:half], weight[half:]
    return [(gate[c : c + width], up[c : c + width]) for c in range(0, half, width)]


def to_paired_tiles(weight: torch.Tensor) -> torch.Tensor:
    """The MLP's ``[2 I, in]`` gate/up weight (gate rows, then up rows) in the paired layout:
    for each run of a tile's width, its gate rows and then its up rows as one tiled matrix (see
    the C source). A new flat tensor of exactly :func:`to_tiles`'s size."""
    if weight.shape[0] % 2:
        raise ValueError(f"a gate/up weight has an even number of rows, got {weight.shape[0]}")
    return torch.cat([to_tiles(torch.cat(pair)) for pair in _pair_runs(weight)])


def from_paired_tiles(tiles: torch.Tensor, in_features: int) -> torch.Tensor:
    """The plain ``[2 I, in]`` matrix back from :func:`to_paired_tiles`'s layout (a copy)."""
    padded, width = _padded(in_features, tiles.dtype), tile_width()
    half = tiles.numel() // padded // 2
    gates, ups, start = [], [], 0
    for c in range(0, half, width):
        w = min(width, half - c)
        block = from_tiles(tiles[start : start + 2 * w * padded], in_features)
        gates.append(block[:w])
        ups.append(block[w:])
        start += 2 * w * padded
    return torch.cat(gates + ups)


def tiled_gate_up(
    x: torch.Tensor, tiles: torch.Tensor, epilogue: int | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The gate/up product of ``x`` for a weight in :func:`to_paired_tiles`'s layout: with
    ``epilogue`` (the address of layer_ops' ``silu_and_mul_rows`` for this dtype), ``silu(gate) *
    up`` ``[..., I]``; without, the plain ``[..., 2 I]`` product. Into ``out`` when given, as in
    :func:`tiled_linear`."""
    in_features, dtype = x.shape[-1], tiles.dtype
    half = tiles.numel() // _padded(in_features, dtype) // 2
    flat = x.dim() == 2 and x.is_contiguous()  # as in tiled_linear
    rows = x if flat else x.reshape(-1, in_features).contiguous()
    count = rows.shape[0]
    width = half if epilogue is not None else 2 * half
    out = _output(out, count, width, dtype)
    if count:
        status = getattr(_library(), _GATE_UP_ENTRY[dtype])(
            rows.data_ptr(), tiles.data_ptr(), out.data_ptr(), count, in_features, half, epilogue
        )
        if status:
            raise MemoryError("the tiled gate/up kernel could not allocate its workspace")
    return out if flat else out.view(*x.shape[:-1], width)
