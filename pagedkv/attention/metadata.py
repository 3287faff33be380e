"""What one forward step tells the attention layers about the batch it carries, and what a
layer tells the kernels about itself.

The model runner builds one :class:`AttentionMetadata` per step from the executor's plan; every
attention layer reads it. It is the whole contract between the engine (requests, block tables)
and the attention kernels (tensors): nothing about requests crosses it. An object describes one
step: a backend keeps what it derives from it for the step's other layers in it
(:meth:`AttentionMetadata.derived`: the CPU backend's kernel rows), so every step gets a new
one, even over the same tensors (a CUDA graph's inputs), and nothing of a step outlives it.
:class:`AttentionOptions` is fixed per layer when the model is built.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's attention arithmetic: softmax scale, optional sliding window and logit soft-cap.

    Checked once, here, when the layer is built (or a standalone op is called).
    """

    scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(float(self.scale)) or float(self.scale) <= 0:
            raise ValueError(f"scale must be a positive finite number, got {self.scale!r}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window must be a positive integer or None, got {window!r}")
        cap = self.soft_cap
        if cap is not None and (not math.isfinite(float(cap)) or float(cap) <= 0):
            raise ValueError(f"soft_cap must be a positive finite number or None, got {cap!r}")
        object.__setattr__(self, "scale", float(self.scale))


@dataclass
class AttentionMetadata:
    """The step's tokens are packed: sequence ``b`` owns query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, which are the *last* ``q_len`` positions of its
    ``context_lens[b]`` tokens (cached prefix + tokens computed this step).

    slot_mapping: [T] int64, physical slot (block_id * block_size + offset) that each new token's
        key/value is written to; a negative slot means "do not write" (padding). Empty when a
        standalone attention call writes nothing.
    block_tables: [B, max_blocks] int32, logical -> physical block ids per sequence (padded
        with any valid id; entries past a sequence's length are never read).
    context_lens: [B] int32, tokens each sequence attends over after this step's writes.
    cu_seqlens_q: [B + 1] int32, prefix sums of the query lengths.
    max_query_len: the longest query length in the step (1 means a pure decode step).
    prompt_lens: [B] int32 or None, each sequence's prompt length. A backend with two kernels for
        query rows (the CPU one: prefill tiles and rows) then picks by position -- prompt
        positions one way, generated ones the other -- so a token's attention is computed the
        same way when a preempted sequence computes it again, and its outputs do not change.
        None (standalone calls): by the length of each run.

    The last three fields are what the host already knows of the tensors (vLLM's names), so that
    no kernel launch waits on the device to learn a shape: the model runner fills them from the
    step plan. None (standalone calls) reads them from the tensors, which on CUDA is a host sync.

    max_seq_len: at least the longest of ``context_lens`` (exactly it, or a CUDA graph's bound:
        it sizes launches, never what a kernel reads); also bounds the positions (< it).
    num_actual_tokens: ``cu_seqlens_q[-1]``, the query rows that belong to sequences.
    slots_padded: whether any ``slot_mapping`` entry is negative.
    groups: with KV groups (hybrid paging), each group's metadata -- the same step with that
        group's slots and block tables -- by group; a layer reads its group's
        (:meth:`of_group`). None: one block table per sequence serves every layer.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    prompt_lens: torch.Tensor | None = None
    max_seq_len: int | None = None
    num_actual_tokens: int | None = None
    slots_padded: bool | None = None
    groups: tuple[AttentionMetadata, ...] | None = None
    #: what backends derived from this step for their kernels, by key (:meth:`derived`)
    _derived: dict[Hashable, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def for_attention_only(
        cls, block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None
    ) -> AttentionMetadata:
        """Metadata for a standalone attention call (no write): decode when ``cu_seqlens_q`` is
        None (one query row per sequence), else prefill."""
        device = block_tables.device
        if cu_seqlens_q is None:
            cu_seqlens_q = torch.arange(block_tables.shape[0] + 1, dtype=torch.int32, device=device)
            max_query_len = 1
        else:
            lengths = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
            max_query_len = int(lengths.max()) if lengths.numel() else 0
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return cls(empty, block_tables, context_lens, cu_seqlens_q, max_query_len)

    def of_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group ``group`` reads: its group's, or this one without
        groups."""
        return self if self.groups is None else self.groups[group]

    def derived(self, key: Hashable, build: Callable[[AttentionMetadata], T]) -> T:
        """``build(self)``, made by the step's first layer that asks for ``key`` and kept for its
        other layers (a backend's kernel arguments: the same for every layer of the step)."""
        if key not in self._derived:
            self._derived[key] = build(self)
        return self._derived[key]

    @functools.cached_property
    def has_padding(self) -> bool:
        """Whether a slot is negative (a token whose key/value is not written): ``slots_padded``,
        else asked once per step instead of once per layer, since on CUDA each ask waits for the
        device."""
        if self.slots_padded is not None:
            return self.slots_padded
        return bool((self.slot_mapping < 0).any())

    def longest_context(self) -> int:
        """``max_seq_len``, else the longest of ``context_lens`` (a host sync on CUDA)."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return int(self.context_lens.max()) if self.context_lens.numel() else 0

    def query_rows(self) -> int:
        """``num_actual_tokens``, else ``cu_seqlens_q[-1]`` (a host sync on CUDA)."""
        if self.num_actual_tokens is not None:
            return self.num_actual_tokens
        return int(self.cu_seqlens_q[-1]) if self.cu_seqlens_q.numel() else 0

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])
