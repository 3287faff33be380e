"""The C paged-attention kernel's entry points (``csrc/paged_attention.c``), by dtype.

The kernel reads keys and values in place from the block pool, which no composition of torch
operators can do without first copying every context. :mod:`pagedkv.attention.backends.cpu`
decides which rows it takes and calls it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedkv.kernels import library
from pagedkv.kernels.library import Entry
from pagedkv.kernels.signatures import POOL_SUFFIXES, SUFFIXES

#: the most query heads per KV head the kernel takes: its per-head arrays live on the stack
MAX_GROUP = 64


@dataclass(frozen=True)
class PagedAttention:
    """The kernel's entry points in this build (float16 is missing from builds without
    ``_Float16``)."""

    #: ``(query dtype, pool dtype) -> paged_attention_rows_*``: one query row per work item
    rows: dict[tuple[torch.dtype, torch.dtype], Entry]
    #: ``dtype -> paged_attention_prefill_*``: tiles of consecutive prompt rows
    prefill: dict[torch.dtype, Entry]
    #: query rows x query heads of one prefill tile
    prefill_lanes: int

    def rows_fn(self, dtype: torch.dtype, pool_dtype: torch.dtype | None = None) -> Entry | None:
        """The row entry for queries in ``dtype`` over pools of ``pool_dtype`` (default
        ``dtype``; else a quantized one, read with its scales), or None."""
        return self.rows.get((dtype, pool_dtype or dtype))

    def prefill_fn(self, dtype: torch.dtype) -> Entry | None:
        """The prefill-tile entry for queries and pools in ``dtype``, or None."""
        return self.prefill.get(dtype)


@functools.cache
def load() -> PagedAttention:
    """The kernel's entry points; :class:`~pagedkv.kernels.library.KernelsUnavailable` without
    the library."""
    lib = library.load()
    rows, prefill = {}, {}
    for dtype, suffix in SUFFIXES.items():
        pools = {dtype: suffix} | {pool: f"{suffix}_{name}" for pool, name in POOL_SUFFIXES.items()}
        for pool, name in pools.items():
            if (fn := lib.entry(f"paged_attention_rows_{name}")) is not None:
                rows[dtype, pool] = fn
        if (fn := lib.entry(f"paged_attention_prefill_{suffix}")) is not None:
            prefill[dtype] = fn
    return PagedAttention(rows, prefill, lib.entry("paged_attention_prefill_lanes")())
