"""The ``cpu`` backend: the default on CPU.

Decode, and every query run of a prefill step up to ``NATIVE_MAX_QUERY_LEN`` tokens (decode
rows in a mixed batch, chunks, prompts), go through the native kernel
(:mod:`pagedkv.attention.backends.native`), which reads keys and values straight out of the
block pool. Longer prefill runs gather one sequence's context at a time and call
``scaled_dot_product_attention``: their cost is quadratic in the query length, so one
linear-size gather is noise next to it. Soft-capped attention always takes the kernel (SDPA
has no soft-cap).
Without a C compiler the kernel's share falls back to the ``torch`` reference, with a warning.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv.attention.backends import native, torch_backend
from pagedkv.attention.kv_cache import LayerKV
from pagedkv.attention.metadata import AttentionMetadata, AttentionOptions

#: blocks of every cache dtype: the kernel reads quantized ones in place
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
#: query runs at most this long use the native kernel, longer ones gather + SDPA. Measured with
#: `benchmarks/attention.py --prefill` (context 1024, fp32, 2 cores): the kernel was faster at
#: every chunk length up to the whole 1024-token prompt (299 ms vs 631 ms). Longer prompts keep
#: SDPA, whose tiling stays in cache where the row kernel re-reads the context once per token.
NATIVE_MAX_QUERY_LEN = 1024
#: bounds on the positions one kernel task covers (flash-decoding split of long contexts)
MIN_CHUNK, MAX_CHUNK = 64, 2048
#: multiply-adds per pass below which the kernel runs on one thread (about 0.1 ms of work)
PARALLEL_MIN_WORK = 1 << 20

_warned = False


def _kernel() -> native.NativeKernel | None:
    global _warned
    kernel = native.load()
    if isinstance(kernel, str):
        if not _warned:
            warnings.warn(f"pagedkv cpu attention: {kernel}; using the slow torch reference", stacklevel=3)
            _warned = True
        return None
    return kernel


@dataclass
class KernelRows:
    """What the kernel reads besides ``q`` and the cache, as int32: the block tables and each
    query row's sequence and position. Every layer of a step passes the same rows, so a decode
    step builds them once (:func:`_decode_rows`), not once per layer."""

    tables: Tensor
    row_seq: Tensor
    row_pos: Tensor
    #: attended positions summed over the rows, per sliding window (0: none); sizes the threads
    totals: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, block_tables: Tensor, row_seq: Tensor, row_pos: Tensor) -> KernelRows:
        def as_int32(t: Tensor) -> Tensor:
            return t.to(torch.int32).contiguous()

        return cls(as_int32(block_tables), as_int32(row_seq), as_int32(row_pos))

    def total(self, window: int) -> int:
        if window not in self.totals:
            lengths = self.row_pos.long() + 1
            self.totals[window] = int((lengths.clamp(max=window) if window else lengths).sum())
        return self.totals[window]


def attend_rows(
    q: Tensor,
    layer: LayerKV,
    block_tables: Tensor,
    row_seq: Tensor,
    row_pos: Tensor,
    options: AttentionOptions,
) -> Tensor | None:
    """Each query row ``q[r]`` of sequence ``row_seq[r]`` at position ``row_pos[r]`` attends its
    sequence's keys up to that position; ``None`` when the native kernel is unavailable or
    cannot take these tensors."""
    return _attend(q, layer, KernelRows.of(block_tables, row_seq, row_pos), options)


def _attend(q: Tensor, layer: LayerKV, rows: KernelRows, options: AttentionOptions) -> Tensor | None:
    if q.device.type != "cpu":
        raise ValueError(
            f"the cpu attention backend needs CPU tensors, got {q.device}; use 'triton' or 'torch'"
        )
    kernel = _kernel()
    num_heads = q.shape[1]
    entry = kernel.fn(q.dtype, layer.key.dtype) if kernel is not None else None
    if entry is None or num_heads // layer.num_kv_heads > native.MAX_GROUP:
        return None
    key, value = layer.key, layer.value
    if not (key.is_contiguous() and value.is_contiguous()):
        key, value = key.contiguous(), value.contiguous()
    q = q.contiguous()
    window = options.sliding_window or 0
    total = rows.total(window)
    # Like torch's own grain size: small work stays on one thread, where a fork/join costs more
    # than it saves (and a thread descheduled on a busy machine stalls the whole region).
    threads = torch.get_num_threads() if total * num_heads * layer.head_dim >= PARALLEL_MIN_WORK else 1
    per_task = math.ceil(total / (4 * threads))
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, per_task))
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


#: the latest decode step's metadata and its kernel rows (held, so its id cannot be reused)
_last_decode: tuple[AttentionMetadata | None, KernelRows | None] = (None, None)


def _decode_rows(metadata: AttentionMetadata) -> KernelRows:
    """The kernel rows of a decode step, built by its first layer and reused by the others."""
    global _last_decode
    seen, rows = _last_decode
    if seen is not metadata or rows is None:
        row_seq = torch.arange(metadata.context_lens.shape[0], dtype=torch.int32)
        rows = KernelRows.of(metadata.block_tables, row_seq, metadata.context_lens - 1)
        _last_decode = (metadata, rows)
    return rows


def decode(q: Tensor, layer: LayerKV, metadata: AttentionMetadata, options: AttentionOptions) -> Tensor:
    out = _attend(q, layer, _decode_rows(metadata), options)
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
class PrefillSplit:
    """How a prefill step's query runs split between the kernel and SDPA; the same for every
    layer, so it is built once per step (:func:`_prefill_split`) instead of with Python loops in
    every layer."""

    #: ``(sequence, first row, end row, context length)`` of each run SDPA takes
    long_runs: list[tuple[int, int, int, int]]
    #: ``(sequence, first row, end row)`` of each run the kernel takes
    short_runs: list[tuple[int, int, int]]
    #: the query rows of the kernel's share; None when it is every row
    rows: Tensor | None
    kernel_rows: KernelRows | None


#: the latest prefill step's metadata, whether SDPA may take long runs, and its split
_last_prefill: tuple[AttentionMetadata | None, bool, PrefillSplit | None] = (None, False, None)


def _prefill_split(metadata: AttentionMetadata, sdpa_allowed: bool) -> PrefillSplit:
    global _last_prefill
    seen, allowed, split = _last_prefill
    if seen is metadata and allowed == sdpa_allowed and split is not None:
        return split
    cu = metadata.cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    context_lens = metadata.context_lens.long()
    is_long = q_lens > NATIVE_MAX_QUERY_LEN if sdpa_allowed else torch.zeros_like(q_lens, dtype=torch.bool)
    starts, ends, lens, longs = cu[:-1].tolist(), cu[1:].tolist(), context_lens.tolist(), is_long.tolist()
    long_runs = [(b, starts[b], ends[b], lens[b]) for b in range(len(lens)) if longs[b]]
    short_runs = [(b, starts[b], ends[b]) for b in range(len(lens)) if not longs[b] and ends[b] > starts[b]]
    rows, kernel_rows = None, None
    if short_runs:
        row_seq = torch.repeat_interleave(torch.arange(len(lens)), q_lens)
        row_pos = context_lens[row_seq] - q_lens[row_seq] + torch.arange(row_seq.shape[0]) - cu[row_seq]
        if long_runs:
            rows = (~is_long[row_seq]).nonzero().flatten()
            row_seq, row_pos = row_seq[rows], row_pos[rows]
        kernel_rows = KernelRows.of(metadata.block_tables, row_seq, row_pos)
    split = PrefillSplit(long_runs, short_runs, rows, kernel_rows)
    _last_prefill = (metadata, sdpa_allowed, split)
    return split


def prefill(q: Tensor, layer: LayerKV, metadata: AttentionMetadata, options: AttentionOptions) -> Tensor:
    if q.device.type != "cpu":
        raise ValueError(
            f"the cpu attention backend needs CPU tensors, got {q.device}; use 'triton' or 'torch'"
        )
    split = _prefill_split(metadata, options.soft_cap is None)
    if split.kernel_rows is not None and not split.long_runs:
        result = _attend(q, layer, split.kernel_rows, options)
        if result is not None:
            return result
    out = torch.empty_like(q)
    tables = metadata.block_tables
    for b, start, end, context_len in split.long_runs:
        window = options.sliding_window
        out[start:end] = sdpa_sequence(q[start:end], layer, tables[b], context_len, options.scale, window)
    if split.kernel_rows is None:
        return out
    result = None
    if split.long_runs:  # else the kernel was tried above
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
