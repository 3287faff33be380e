"""LoRA adapters' outputs for a batch of rows of mixed adapters on the CPU, each row by its own
adapter only (Punica's and S-LoRA's BGMV; ``csrc/lora_bgmv.c``).

A projection's slot tensors hold every resident adapter (:mod:`pagedkv.models.lora`): the
kernel gathers each row's adapter by its slot, shrinks the row into the adapter's rank, scales
it and expands it into the row's output columns, skipping rows of no adapter and, in a packed
projection (q/k/v, gate/up), the zero blocks of ``B`` outside each block's own columns. Its
work is the rows' own adapters' products, whatever the number of resident adapters.
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
def _entry(dtype: torch.dtype) -> Entry:
    return library.load().entry(f"lora_bgmv_{SUFFIXES[dtype]}")


def takes(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the C kernel runs rows ``x`` on slot tensors like ``a``: on the CPU, with the
    kernels library, both of one of :data:`DTYPES`."""
    return (
        x.device.type == "cpu"
        and a.device.type == "cpu"
        and x.dtype == a.dtype
        and x.dtype in DTYPES
        and library.why_unavailable() is None
    )


def check_arguments(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
    columns: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """ValueError naming what does not fit :func:`lora_bgmv`'s contract (shared by the Triton
    pair, :mod:`pagedkv.kernels.triton_lora`)."""
    slots, rows_per_slot, n_in = a.shape
    shards = columns.shape[0] - 1
    rows, n_out = out.shape
    if x.shape != (rows, n_in) or b.shape != (slots, rows_per_slot, n_out) or rows_per_slot % shards:
        raise ValueError(
            f"LoRA shapes do not match: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"out {tuple(out.shape)}, {shards} shards"
        )
    if row_slot.shape != (rows,) or row_slot.dtype != torch.int32 or scaling.dtype != torch.float32:
        raise ValueError("row_slot must be int32 [rows] and scaling float32 [slots]")
    if not out.is_contiguous():
        raise ValueError("lora_bgmv adds into a contiguous output")


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
    check_arguments(x, a, b, row_slot, scaling, columns, out)
    slots, rows_per_slot, n_in = a.shape
    shards = columns.shape[0] - 1
    rows, n_out = out.shape
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    row_slot, scaling, columns = row_slot.contiguous(), scaling.contiguous(), columns.contiguous()
    status = _entry(x.dtype)(
        x.data_ptr(),
        a.data_ptr(),
        b.data_ptr(),
        row_slot.data_ptr(),
        scaling.data_ptr(),
        columns.data_ptr(),
        out.data_ptr(),
        rows,
        n_in,
        n_out,
        slots,
        rows_per_slot // shards,
        shards,
    )
    if status == 1:
        raise MemoryError("lora_bgmv could not allocate its row order")
    if status:
        raise IndexError(f"a row's adapter slot is outside the {slots} slots: {row_slot.tolist()}")
    return out
