"""LoRA adapters' outputs for a batch of rows of mixed adapters on CUDA (Triton): Punica's
BGMV as a shrink and an expand kernel, with the contract of the CPU's C kernel
(:func:`pagedkv.kernels.lora_bgmv.lora_bgmv`).

- **Shrink**: one program per (row, block of ``rank`` rows, ``BLOCK_R`` of them) gathers the
  row's adapter by its slot and writes ``scaling[s] * (A_s x_r)`` for its rank rows into a
  float32 ``[T, shards * rank]`` intermediate. Splitting the rank, not the input, keeps each
  sum in one program: a row's result does not depend on the batch it is in.
- **Expand**: one program per (row, ``BLOCK_N`` output columns) finds each column's block ``p``
  (the bounds ``columns``), sums the ``rank`` products of that block's intermediate and ``B``
  rows in float32, and adds the sum to ``out``, rounded once to its dtype. A packed projection's
  ``B`` is read only inside each block's own columns, where it is not zero.

A row of no adapter (slot -1) returns at once in both kernels: its output is left as it is.
Nothing depends on a device value at launch (the grid is the shapes'), so the pair never makes
the host wait. For CPU tensors the kernels run in Triton's interpreter (:mod:`.triton_launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_launch import launch, to_storage

#: the dtypes the kernels take (activations and slot tensors of one dtype)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lora_shrink_kernel(
    x_ptr,  # [T, n_in]
    a_ptr,  # [slots, rows_per_slot, n_in]
    row_slot_ptr,  # [T] int32
    scaling_ptr,  # [slots] float32
    low_ptr,  # [T, rows_per_slot] float32
    n_in,
    rank,
    rows_per_slot,
    stride_x,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(row_slot_ptr + row)
    if slot < 0:
        return
    i = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    i_ok = i < rank
    j = tl.program_id(1) * rank + i  # the slot's rank rows of this block
    a_rows = a_ptr + (slot.to(tl.int64) * rows_per_slot + j)[:, None] * n_in
    x_row = x_ptr + row.to(tl.int64) * stride_x
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < n_in
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=i_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    acc = acc * tl.load(scaling_ptr + slot)
    tl.store(low_ptr + row.to(tl.int64) * rows_per_slot + j, acc, mask=i_ok)


def lora_expand_kernel(
    low_ptr,  # [T, rows_per_slot] float32
    b_ptr,  # [slots, rows_per_slot, n_out]
    row_slot_ptr,  # [T] int32
    columns_ptr,  # [shards + 1] int64
    out_ptr,  # [T, n_out]
    n_out,
    rank,
    rows_per_slot,
    shards,
    stride_out,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(row_slot_ptr + row)
    if slot < 0:
        return
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = (c >= tl.load(columns_ptr)) & (c < tl.load(columns_ptr + shards)) & (c < n_out)
    # each column's block: how many of the inner bounds columns[1..shards) are at or below it
    q = tl.arange(0, BLOCK_S)
    bounds = tl.load(columns_ptr + 1 + q, mask=q < shards - 1, other=n_out)
    block = tl.sum((c[:, None] >= bounds[None, :]).to(tl.int32), axis=1)
    low_row = low_ptr + row.to(tl.int64) * rows_per_slot
    b_slot = b_ptr + slot.to(tl.int64) * rows_per_slot * n_out
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        i = r0 + tl.arange(0, BLOCK_R)
        j = block[None, :] * rank + i[:, None]  # [BLOCK_R, BLOCK_N]: each column's block's rows
        ok = (i < rank)[:, None] & c_ok[None, :]
        low = tl.load(low_row + j, mask=ok, other=0.0)
        b = tl.load(b_slot + j.to(tl.int64) * n_out + c[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += tl.sum(low * b, axis=0)
    out = out_ptr + row.to(tl.int64) * stride_out + c
    total = tl.load(out, mask=c_ok, other=0.0).to(tl.float32) + acc
    tl.store(out, to_storage(total, out_ptr.dtype.element_ty), mask=c_ok)


def takes(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether :func:`lora_bgmv` runs rows ``x`` on slot tensors like ``a`` as compiled code:
    both on one CUDA device, of one dtype of :data:`DTYPES`."""
    return x.device.type == "cuda" and a.device == x.device and x.dtype == a.dtype and x.dtype in DTYPES


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def lora_bgmv(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slot: torch.Tensor,
    scaling: torch.Tensor,
    columns: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`pagedkv.kernels.lora_bgmv.lora_bgmv`'s contract (``out += scaling[s] * B_s (A_s
    x_r)`` per row of a slot, a slot tensor's block ``p`` writing ``columns[p]:columns[p + 1]``)
    on any device, ``columns`` moved to the rows' device when it is elsewhere. A slot outside
    ``[-1, slots)`` is not checked (that would wait for the device)."""
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
    if rows == 0:
        return out
    device, rank = x.device, rows_per_slot // shards
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    columns = columns.to(device=device, dtype=torch.int64, non_blocking=True)
    low = torch.empty((rows, rows_per_slot), dtype=torch.float32, device=device)
    block_r = min(16, _pow2(rank))
    launch(
        lora_shrink_kernel,
        (rows, shards, triton.cdiv(rank, block_r)),
        device,
        x,
        a,
        row_slot,
        scaling,
        low,
        n_in,
        rank,
        rows_per_slot,
        x.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=min(256, _pow2(n_in)),
    )
    block_n = min(128, _pow2(n_out))
    launch(
        lora_expand_kernel,
        (rows, triton.cdiv(n_out, block_n)),
        device,
        low,
        b,
        row_slot,
        columns,
        out,
        n_out,
        rank,
        rows_per_slot,
        shards,
        out.stride(0),
        BLOCK_N=block_n,
        BLOCK_R=min(16, _pow2(rank)),
        BLOCK_S=_pow2(max(1, shards - 1)),
    )
    return out
