"""LoRA adapters' outputs for a batch of rows of mixed adapters on the CPU, each row by its own
adapter only (Punica's and S-LoRA's BGMV; ``csrc/lora_bgmv.c``).

A projection's adapters are slot tensors (:mod:`pagedkv.models.lora`, :func:`lora_bgmv`) or
rows in their pages of the KV cache, found through a table of offsets
(:mod:`pagedkv.models.lora_paged`, :func:`lora_bgmv_paged`): the kernel gathers each row's
adapter by its slot, shrinks the row into the adapter's rank, scales it and expands it into
the row's output columns, skipping rows of no adapter and, in a packed projection (q/k/v,
gate/up), every column outside each block's own. Its work is the rows' own adapters' products,
whatever the number of resident adapters; both forms give the same bits.
"""

from __future__ import annotations

import functools

import torch

from pagedkv.kernels import library
from pagedkv.kernels.library import Entry
from pagedkv.kernels.signatures import SUFFIXES

#: the dtypes the C kernel takes (activations and slot tensors alike)
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _entry(name: str) -> Entry:
    return library.load().entry(name)


def takes(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the C kernel runs rows ``x`` on weights held in ``a`` (slot tensors, or the KV
    cache holding an adapter's pages): on the CPU, with the kernels library, both of one of
    :data:`DTYPES`."""
    return (
        x.device.type == "cpu"
        and a.device.type == "cpu"
        and x.dtype == a.dtype
        and x.dtype in DTYPES
        and library.why_unavailable() is None
    )


def lora_bgmv(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
    columns: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out [T, out]`` (contiguous) plus each row's adapter output, in place: ``scaling[s] *
    B_s (A_s x_r)`` for row ``r`` of slot ``s = row_slot[r]`` (int32; -1: none, left as it is).
    ``x [T, in]``; ``a [slots, shards * rank, in]``, ``b [slots, shards * rank, out]``; block
    ``p`` of ``rank`` rows writes the columns ``columns[p]:columns[p + 1]`` (int64, ``[shards
    + 1]``); ``scaling [slots]`` float32."""
    slots, rows_per_slot, n_in = a.shape
    shards = columns.shape[0] - 1
    if b.shape != (slots, rows_per_slot, out.shape[1]) or rows_per_slot % shards:
        raise ValueError(
            f"LoRA slot tensors a {tuple(a.shape)}, b {tuple(b.shape)} do not match {shards} shards"
        )
    a, b = a.contiguous(), b.contiguous()
    return _call(
        f"lora_bgmv_{SUFFIXES[x.dtype]}",
        x,
        a,
        b,
        row_slot,
        scaling,
        columns,
        out,
        n_in,
        slots,
        rows_per_slot // shards,
    )


def lora_bgmv_paged(
    x: torch.Tensor,
    base: torch.Tensor,
    offsets: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
    columns: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`lora_bgmv` with each slot's rank rows read where they live in ``base`` (the KV
    cache's tensor, of ``x``'s dtype): ``offsets [slots, 2, shards * rank]`` (int64) holds the
    element offset of each ``A`` row (``in`` elements) then of each ``B`` row (``B`` transposed:
    block ``p``'s rows hold its ``columns[p + 1] - columns[p]`` columns only); a negative offset
    is a zero row (a smaller rank's padding). The caller keeps the offsets inside ``base``."""
    slots, two, rows_per_slot = offsets.shape
    shards = columns.shape[0] - 1
    if two != 2 or offsets.dtype != torch.int64 or rows_per_slot % shards or base.dtype != x.dtype:
        raise ValueError(
            f"LoRA page offsets {tuple(offsets.shape)} {offsets.dtype} over a {base.dtype} cache do not "
            f"match {shards} shards of {x.dtype} rows"
        )
    if not base.is_contiguous():
        raise ValueError("lora_bgmv_paged reads a contiguous KV cache")
    offsets = offsets.contiguous()
    return _call(
        f"lora_bgmv_paged_{SUFFIXES[x.dtype]}",
        x,
        base,
        offsets,
        row_slot,
        scaling,
        columns,
        out,
        x.shape[1],
        slots,
        rows_per_slot // shards,
    )


def _call(
    name: str,
    x: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
    columns: torch.Tensor,
    out: torch.Tensor,
    n_in: int,
    slots: int,
    rank: int,
) -> torch.Tensor:
    """One call of entry ``name`` with the arguments both forms share, checked."""
    rows, n_out = out.shape
    if x.shape != (rows, n_in):
        raise ValueError(
            f"LoRA rows x {tuple(x.shape)} do not match out {tuple(out.shape)} and {n_in} inputs"
        )
    if row_slot.shape != (rows,) or row_slot.dtype != torch.int32 or scaling.dtype != torch.float32:
        raise ValueError("row_slot must be int32 [rows] and scaling float32 [slots]")
    if not out.is_contiguous():
        raise ValueError("lora_bgmv adds into a contiguous output")
    x, row_slot, scaling, columns = (
        x.contiguous(),
        row_slot.contiguous(),
        scaling.contiguous(),
        columns.contiguous(),
    )
    status = _entry(name)(
        x.data_ptr(),
        first.data_ptr(),
        second.data_ptr(),
        row_slot.data_ptr(),
        scaling.data_ptr(),
        columns.data_ptr(),
        out.data_ptr(),
        rows,
        n_in,
        n_out,
        slots,
        rank,
        columns.shape[0] - 1,
    )
    if status == 1:
        raise MemoryError("lora_bgmv could not allocate its row order")
    if status:
        raise IndexError(f"a row's adapter slot is outside the {slots} slots: {row_slot.tolist()}")
    return out
