"""pagedkv's own GEMM for the CPU linear layers (float32 and bfloat16), on weights stored in
column tiles (``csrc/tiled_gemm.c``).

A decode step reads every weight from DRAM once for a few rows, so its speed is the rate at which
the weights stream. The kernel stores each run of 64 output columns as one contiguous tile that
its k loop reads front to back, reusing it from L2 for every block of 6 rows; prefill's thousands
of rows run on the same loop.

The tiled weight is a flat tensor of the weight's dtype holding exactly its elements (bfloat16
adds a zero k row when ``in`` is odd; see the C source for the layout): a 1-D weight is how
:func:`pagedkv.models.linear.linear` knows it, and ``in`` comes from the input's last dimension.
Every sum runs over k in order, so a row's output does not depend on how many rows share its
call. bfloat16 sums k in pairs, each pair's odd product first, in float32: AVX512-BF16's dot
products of pairs (``vdpbf16ps``, oneDNN's instruction) where the CPU has them -- there the
outputs equal ``F.linear``'s (oneDNN's) bit for bit for a few rows, and for many rows all but
the rare last bit where oneDNN sums k in another order -- and on AVX2 the same sums with each
pair widened to float32 as it is loaded (tested against the pairs written out in torch; a
product of bfloat16 values is exact in float32, so only denormals, which vdpbf16ps flushes, can
round differently). Without AVX512-BF16, oneDNN has no bfloat16 of its own and ``F.linear``
runs torch's emulated one, several times slower than this loop.

Where the CPU has AMX (``csrc/gemm_amx.h``), bfloat16 runs on its tile multiplies instead, from
:func:`amx_rows` rows: the pairs as the tiles hold them are AMX's B operand in place, so the same
weight serves both loops. Each output still sums its k pairs in order in float32 (a row's bits
still do not depend on its batch) and equals oneDNN's, which multiplies on AMX there too, for a
few dozen rows; AMX adds a pair's two products before the sum, so now and then a last bit differs
from vdpbf16ps' two adds. On such a CPU the tile multiplies are many times faster than the dot
products from a handful of rows up, and no slower for one.
"""

from __future__ import annotations

import functools

import torch

from pagedkv.kernels import library
from pagedkv.kernels.library import Entry
from pagedkv.kernels.signatures import SUFFIXES

#: k values stored side by side per column: bfloat16 runs on dot products of pairs
_GROUP = {torch.float32: 1, torch.bfloat16: 2}

#: what :func:`bf16_loop` returns: the C source's loops for bfloat16
BF16_PORTABLE, BF16_WIDENING, BF16_DOT = 0, 1, 2


@functools.cache
def tile_width() -> int:
    """Output columns per tile, as compiled (:class:`~pagedkv.kernels.library.KernelsUnavailable`
    without the library)."""
    return library.load().entry("tiled_gemm_tile_width")()


def bf16_loop() -> int:
    """Which loop runs bfloat16 here, as compiled: ``BF16_DOT`` (AVX512-BF16's dot products of
    pairs), ``BF16_WIDENING`` (AVX2: pairs widened to float32 as loaded) or ``BF16_PORTABLE``.
    The first two give the same bits (see the C source); the portable one is too slow to choose."""
    return library.load().entry("tiled_gemm_bf16_loop")()


def amx_rows() -> int:
    """Rows from which a bfloat16 product runs on AMX tiles here (0: never): where the library was
    built for AMX-TILE and AMX-BF16, Linux granted the process the tile state, and
    ``PAGEDKV_TILED_AMX=0`` is not in the environment (read once, at the first product)."""
    return library.load().entry("tiled_gemm_amx_rows")()


def why_unavailable(dtype: torch.dtype) -> str | None:
    """Why the tiled kernel cannot run ``dtype`` here, or None when it can."""
    if (why := library.why_unavailable()) is not None:
        return why
    if dtype not in _GROUP:
        return f"the tiled kernel has no {str(dtype).removeprefix('torch.')}"
    if dtype == torch.bfloat16 and bf16_loop() == BF16_PORTABLE:
        return "the tiled bfloat16 kernel needs AVX512-BF16, or AVX2 with FMA"
    return None


@functools.cache
def _entries(dtype: torch.dtype) -> tuple[Entry, Entry]:
    """The linear and the gate/up entry points for ``dtype``."""
    lib, suffix = library.load(), SUFFIXES[dtype]
    return lib.entry(f"tiled_linear_{suffix}"), lib.entry(f"tiled_gate_up_{suffix}")


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
    if library.load().entry("tiled_rows")(tiles.data_ptr(), flat.data_ptr(), rows.data_ptr(), *args):
        raise IndexError(f"a token id is outside the vocabulary of {out_features}: {ids.tolist()}")
    return rows.view(*ids.shape, in_features)


def _output(out: torch.Tensor | None, count: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (a contiguous ``[count, width]`` tensor of ``dtype`` the caller keeps between
    steps, see :class:`pagedkv.models.linear.OutputBuffer`), or a new one."""
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

    A contiguous 2-D ``x`` (every call of the step program, several per layer and step) skips
    the reshape and the view back: on small batches they cost as much as the call itself."""
    in_features, dtype = x.shape[-1], tiles.dtype
    out_features = tiles.numel() // _padded(in_features, dtype)
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, in_features).contiguous()
    count = rows.shape[0]
    out = _output(out, count, out_features, dtype)
    if count:
        failed = _entries(dtype)[0](
            rows.data_ptr(),
            tiles.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            count,
            in_features,
            out_features,
        )
        if failed:
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
    x: torch.Tensor, tiles: torch.Tensor, fused: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The gate/up product of ``x`` for a weight in :func:`to_paired_tiles`'s layout: ``fused``,
    ``silu(gate) * up`` ``[..., I]`` (the fused ``silu_and_mul`` op's arithmetic, applied to each
    block of columns while it is in cache); else the plain ``[..., 2 I]`` product. Into ``out``
    when given, as in :func:`tiled_linear`."""
    in_features, dtype = x.shape[-1], tiles.dtype
    half = tiles.numel() // _padded(in_features, dtype) // 2
    flat = x.dim() == 2 and x.is_contiguous()  # as in tiled_linear
    rows = x if flat else x.reshape(-1, in_features).contiguous()
    count = rows.shape[0]
    width = half if fused else 2 * half
    out = _output(out, count, width, dtype)
    if count:
        status = _entries(dtype)[1](
            rows.data_ptr(), tiles.data_ptr(), out.data_ptr(), count, in_features, half, int(fused)
        )
        if status:
            raise MemoryError("the tiled gate/up kernel could not allocate its workspace")
    return out if flat else out.view(*x.shape[:-1], width)
