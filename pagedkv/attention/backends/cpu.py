"""The ``cpu`` backend: the default on CPU.

Everything goes through the C kernel (:mod:`pagedkv.kernels.paged_attention`), which reads
keys and values straight out of the block pool. Prompt rows take its tile entry (prompts,
chunks, continuations after a cached prefix), which reads the context once per tile of
consecutive rows instead of once per row. Generated rows -- decodes, and a preempted
sequence's generated tokens computed again -- take its row entry, one query row per work item,
so a recomputed token is attended exactly as the first time (the engine passes the prompt
lengths; without them, runs of at least one tile are tiled). Layers the tiles do not take (a
sliding window, a soft cap, a quantized pool, an unusual head shape) keep the row entry up to
``NATIVE_MAX_QUERY_LEN`` tokens; longer runs then gather one sequence's context and call
``scaled_dot_product_attention`` (quadratic in the query length, so one linear-size gather is
noise next to it), except soft-capped ones (SDPA has no soft-cap).
Without a C compiler the kernel's share falls back to the ``torch`` reference, with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv.attention.backends import torch_backend
from pagedkv.attention.backends.cpu_rows import KernelRows, decode_rows, split_work
from pagedkv.attention.kv_cache import LayerKV
from pagedkv.attention.metadata import AttentionMetadata, AttentionOptions
from pagedkv.kernels import paged_attention
from pagedkv.kernels.library import KernelsUnavailable
from pagedkv.kernels.paged_attention import PagedAttention

#: blocks of every cache dtype: the kernel reads quantized ones in place
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
#: query runs at most this long use the row kernel when the tiles cannot take them, longer ones
#: gather + SDPA, whose tiling stays in cache where the row kernel re-reads the context once per
#: query row.
NATIVE_MAX_QUERY_LEN = 1024

_warned = False


def _kernel() -> PagedAttention | None:
    """The C kernel, or None (warned once) when the kernels library cannot run here."""
    global _warned
    try:
        return paged_attention.load()
    except KernelsUnavailable as exc:
        if not _warned:
            warnings.warn(f"pagedkv cpu attention: {exc}; using the slow torch reference", stacklevel=3)
            _warned = True
        return None


def attend_rows(
    q: Tensor,
    layer: LayerKV,
    block_tables: Tensor,
    row_seq: Tensor,
    row_pos: Tensor,
    options: AttentionOptions,
) -> Tensor | None:
    """Each query row ``q[r]`` of sequence ``row_seq[r]`` at position ``row_pos[r]`` attends its
    sequence's keys up to that position; ``None`` when the C kernel is unavailable or cannot
    take these tensors."""
    return _attend(q, layer, KernelRows.of(block_tables, row_seq, row_pos), options)


def _attend(q: Tensor, layer: LayerKV, rows: KernelRows, options: AttentionOptions) -> Tensor | None:
    if q.device.type != "cpu":
        raise ValueError(
            f"the cpu attention backend needs CPU tensors, got {q.device}; use 'triton' or 'torch'"
        )
    kernel = _kernel()
    num_heads = q.shape[1]
    entry = kernel.rows_fn(q.dtype, layer.key.dtype) if kernel is not None else None
    if entry is None or num_heads // layer.num_kv_heads > paged_attention.MAX_GROUP:
        return None
    key, value = layer.key, layer.value
    if not (key.is_contiguous() and value.is_contiguous()):
        key, value = key.contiguous(), value.contiguous()
    q = q.contiguous()
    window = options.sliding_window or 0
    threads, chunk = split_work(rows.total(window), num_heads, layer.head_dim)
    out = torch.empty_like(q)
    status = entry(
        q.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        layer.key_scale.data_ptr() if layer.quantized else None,
        layer.value_scale.data_ptr() if layer.quantized else None,
        rows.tables.data_ptr(),
        rows.row_seq.data_ptr(),
        rows.row_pos.data_ptr(),
        out.data_ptr(),
        q.shape[0],
        num_heads,
        layer.num_kv_heads,
        layer.head_dim,
        layer.block_size,
        rows.tables.shape[1],
        options.scale,
        window,
        options.soft_cap or 0.0,
        chunk,
        threads,
    )
    if status != 0:
        raise MemoryError("the native paged-attention kernel could not allocate its workspace")
    return out


def decode(q: Tensor, layer: LayerKV, metadata: AttentionMetadata, options: AttentionOptions) -> Tensor:
    out = _attend(q, layer, decode_rows(metadata), options)
    if out is None:
        return torch_backend.decode(q, layer, metadata, options)
    return out


def sdpa_sequence(
    q: Tensor, layer: LayerKV, table_row: Tensor, context_len: int, scale: float, window: int | None
) -> Tensor:
    """One sequence's query run ``q [n, Hq, D]`` (its last ``n`` positions) via SDPA."""
    n = q.shape[0]
    key, value = torch_backend.gather_context(layer, table_row, context_len, q.dtype)
    mask = None
    if n != context_len or window is not None:
        q_pos = torch.arange(context_len - n, context_len)
        mask = torch_backend.allowed_mask(q_pos, torch.arange(context_len), window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        key.transpose(0, 1),
        value.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@dataclass
class PrefillTiles:
    """The tile kernel's share of a prefill step, as int32: each tile's sequence, first query
    row, that row's position and its row count; and the block tables they read."""

    seq: Tensor
    row: Tensor
    pos: Tensor
    count: Tensor
    tables: Tensor


@dataclass
class PrefillSplit:
    """How a prefill step's query runs split between the prefill tiles, the row kernel and SDPA;
    the same for every layer, so it is built once per step (:func:`_prefill_split`) instead of
    with Python loops in every layer."""

    #: ``(sequence, first row, end row, context length)`` of each run SDPA takes
    long_runs: list[tuple[int, int, int, int]]
    #: ``(sequence, first row, end row)`` of each run the row kernel takes
    short_runs: list[tuple[int, int, int]]
    #: the query rows of the row kernel's share; None when it is every row
    rows: Tensor | None
    kernel_rows: KernelRows | None
    #: the runs of at least one whole tile, when the tile kernel can take this layer
    tiles: PrefillTiles | None = None


def _prefill_split(metadata: AttentionMetadata, sdpa_allowed: bool, tile_rows: int) -> PrefillSplit:
    """Which rows the tile kernel takes (``tile_rows`` per tile; 0: none), which runs SDPA takes
    (longer than ``NATIVE_MAX_QUERY_LEN``, when allowed and not tiled) and the rest, for the row
    kernel. With the sequences' prompt lengths, a run's prompt positions are tiled and its
    generated ones are not, whatever the run's length: a token recomputed after a preemption is
    then attended exactly as the first time (prompt rows by tiles, which give a row the same
    result in any tile; generated rows by the row kernel, as decodes). Without them, whole runs
    of at least one tile are tiled. Built by the step's first layer with these flags and kept
    in its metadata for the others."""
    return metadata.derived(
        (_prefill_split, sdpa_allowed, tile_rows), lambda m: _split(m, sdpa_allowed, tile_rows)
    )


def _split(metadata: AttentionMetadata, sdpa_allowed: bool, tile_rows: int) -> PrefillSplit:
    cu = metadata.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    context_lens = metadata.context_lens.long()
    first_pos = context_lens - q_lens
    if not tile_rows:
        tiled_rows = torch.zeros_like(q_lens)
    elif metadata.prompt_lens is not None:
        tiled_rows = (metadata.prompt_lens.long() - first_pos).clamp(min=0).minimum(q_lens)
    else:
        tiled_rows = torch.where(q_lens >= tile_rows, q_lens, 0)
    untiled = q_lens - tiled_rows
    is_long = (untiled > NATIVE_MAX_QUERY_LEN) & (tiled_rows == 0) if sdpa_allowed else untiled < 0
    starts, ends, lens = cu[:-1].tolist(), cu[1:].tolist(), context_lens.tolist()
    longs, first_untiled = is_long.tolist(), (cu[:-1] + tiled_rows).tolist()
    long_runs = [(b, starts[b], ends[b], lens[b]) for b in range(len(lens)) if longs[b]]
    short_runs = [(b, first_untiled[b], ends[b]) for b in range(len(lens)) if not longs[b]]
    short_runs = [run for run in short_runs if run[2] > run[1]]
    rows, kernel_rows = None, None
    if short_runs:
        row_seq = torch.repeat_interleave(torch.arange(len(lens)), q_lens)
        offset = torch.arange(row_seq.shape[0]) - cu[row_seq]
        row_pos = first_pos[row_seq] + offset
        keep = ~is_long[row_seq] & (offset >= tiled_rows[row_seq])
        if not bool(keep.all()):
            rows = keep.nonzero().flatten()
            row_seq, row_pos = row_seq[rows], row_pos[rows]
        kernel_rows = KernelRows.of(metadata.block_tables, row_seq, row_pos)
    tiles = _tiles(metadata, cu, first_pos, tiled_rows, tile_rows) if bool((tiled_rows > 0).any()) else None
    return PrefillSplit(long_runs, short_runs, rows, kernel_rows, tiles)


def _tiles(
    metadata: AttentionMetadata, cu: Tensor, first_pos: Tensor, tiled_rows: Tensor, size: int
) -> PrefillTiles:
    """Cut the first ``tiled_rows[b]`` rows of every run into tiles of ``size`` consecutive rows
    (the last one shorter)."""
    runs = (tiled_rows > 0).nonzero().flatten()
    per_run = (tiled_rows[runs] + size - 1) // size
    seq = torch.repeat_interleave(runs, per_run)
    first_tile = torch.repeat_interleave(per_run.cumsum(0) - per_run, per_run)
    offset = (torch.arange(seq.shape[0]) - first_tile) * size  # of the tile's first row in its run
    row = cu[seq] + offset
    pos = first_pos[seq] + offset
    count = (tiled_rows[seq] - offset).clamp(max=size)

    def as_int32(t: Tensor) -> Tensor:
        return t.to(torch.int32).contiguous()

    return PrefillTiles(*map(as_int32, (seq, row, pos, count, metadata.block_tables)))


def tile_rows(q: Tensor, layer: LayerKV, options: AttentionOptions) -> int:
    """Query rows per prefill tile for this layer, or 0 when the tile kernel cannot take it (a
    window, a soft cap, a quantized pool, or a head shape it was not built for)."""
    kernel = _kernel()
    if kernel is None or options.soft_cap is not None or options.sliding_window or layer.quantized:
        return 0
    if not kernel.prefill_lanes:
        return 0
    group = q.shape[1] // layer.num_kv_heads
    lanes, dim = kernel.prefill_lanes, layer.head_dim
    if (
        kernel.prefill_fn(q.dtype) is None
        or layer.key.dtype != q.dtype
        or lanes % group
        or dim % 16
        or dim % lanes
    ):
        return 0
    return lanes // group


def _attend_tiles(
    q: Tensor, layer: LayerKV, tiles: PrefillTiles, options: AttentionOptions, out: Tensor
) -> None:
    """Write the tiled rows of ``out`` (``q`` and ``out`` contiguous)."""
    kernel = _kernel()
    key, value = layer.key, layer.value
    if not (key.is_contiguous() and value.is_contiguous()):
        key, value = key.contiguous(), value.contiguous()
    status = kernel.prefill_fn(q.dtype)(
        q.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        tiles.tables.data_ptr(),
        tiles.seq.data_ptr(),
        tiles.row.data_ptr(),
        tiles.pos.data_ptr(),
        tiles.count.data_ptr(),
        out.data_ptr(),
        tiles.seq.shape[0],
        q.shape[1],
        layer.num_kv_heads,
        layer.head_dim,
        layer.block_size,
        tiles.tables.shape[1],
        options.scale,
        torch.get_num_threads(),
    )
    if status == 1:
        raise MemoryError("the native prefill attention kernel could not allocate its workspace")
    if status != 0:
        raise ValueError(f"the native prefill attention kernel refused head shape {tuple(q.shape[1:])}")


def prefill(q: Tensor, layer: LayerKV, metadata: AttentionMetadata, options: AttentionOptions) -> Tensor:
    if q.device.type != "cpu":
        raise ValueError(
            f"the cpu attention backend needs CPU tensors, got {q.device}; use 'triton' or 'torch'"
        )
    split = _prefill_split(metadata, options.soft_cap is None, tile_rows(q, layer, options))
    if split.kernel_rows is not None and split.rows is None:  # every row on the row kernel
        result = _attend(q, layer, split.kernel_rows, options)
        if result is not None:
            return result
    q = q.contiguous()
    out = torch.empty_like(q)
    if split.tiles is not None:
        _attend_tiles(q, layer, split.tiles, options, out)
    tables = metadata.block_tables
    for b, start, end, context_len in split.long_runs:
        window = options.sliding_window
        out[start:end] = sdpa_sequence(q[start:end], layer, tables[b], context_len, options.scale, window)
    if split.kernel_rows is None:
        return out
    result = None
    if split.rows is not None:  # else the kernel was tried above
        result = _attend(q[split.rows], layer, split.kernel_rows, options)
    if result is None:
        for b, start, end in split.short_runs:
            single = AttentionMetadata.for_attention_only(
                tables[b : b + 1], metadata.context_lens[b : b + 1], torch.tensor([0, end - start])
            )
            out[start:end] = torch_backend.prefill(q[start:end], layer, single, options)
        return out
    out[split.rows] = result
    return out
