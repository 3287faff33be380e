"""Persistent device buffers for a step's inputs, filled with one copy per step.

A step's inputs (token ids, positions, slots, logits rows, context lengths, query offsets,
prompt lengths, block tables) are small host arrays (:mod:`pagedkv.engine.worker.step_inputs`). Sent
one tensor at a time they would be eight host-to-device copies, each of which waits for the
device when it comes from pageable memory. Here they are laid out in one int64 staging array,
pinned on CUDA, and sent with one non-blocking copy into a device buffer kept from step to step;
the tensors a step reads are views of that buffer, handed to the forward pass as
:class:`StepInputs` with the step's attention metadata over them. A layout is a function of the arrays' sizes
alone (:class:`StepLayout`), so a step of the same sizes reads the same addresses: what a CUDA
graph captured over those views needs.

Two staging arrays alternate, so that one may still be on its way to the device while the next
step fills the other; before a staging array is refilled, its previous copy's event is waited
for. In the engine that copy is long done by then -- the step in between read its sampled
tokens back -- so the wait costs nothing, but it makes the reuse safe whoever drives the runner.
On the CPU the same path runs with plain tensors and no events.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.attention import AttentionMetadata
from pagedkv.engine.worker.step_inputs import StepArrays

#: the fields, in buffer order: int64 ones, then int32 ones (two to a word)
INT64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices")
INT32_FIELDS = ("context_lens", "cu_seqlens_q", "prompt_lens", "block_tables")
#: layouts whose views a buffer keeps: a run of decode steps at one batch size reuses one
#: layout for ``block_size`` steps, and making the views costs more than filling them
KEPT_LAYOUTS = 64


@dataclass(frozen=True)
class StepLayout:
    """Where each field of a step of these sizes lies in the buffer, in int64 words."""

    num_tokens: int
    num_logits: int
    num_seqs: int
    table_width: int
    has_prompt_lens: bool
    #: KV groups: each has its slots and block tables (1: one table per sequence)
    num_groups: int = 1

    @staticmethod
    def of(arrays: StepArrays) -> StepLayout:
        return _layout(
            arrays.input_ids.shape[0],
            arrays.logits_indices.shape[0],
            arrays.context_lens.shape[0],
            arrays.block_tables.shape[-1],
            arrays.prompt_lens is not None,
            arrays.num_groups,
        )

    def elements(self) -> dict[str, int]:
        """Each field's element count, in buffer order."""
        t, s, g = self.num_tokens, self.num_seqs, self.num_groups
        return {
            "input_ids": t,
            "positions": t,
            "slot_mapping": g * t,
            "logits_indices": self.num_logits,
            "context_lens": s,
            "cu_seqlens_q": s + 1,
            "prompt_lens": s if self.has_prompt_lens else 0,
            "block_tables": g * s * self.table_width,
        }

    @functools.cached_property
    def spans(self) -> dict[str, tuple[int, int]]:
        """``field -> (first word, element count)``; every field starts on a word."""
        spans, word = {}, 0
        for name, count in self.elements().items():
            spans[name] = (word, count)
            word += count if name in INT64_FIELDS else -(-count // 2)
        return spans

    @property
    def words(self) -> int:
        first, count = self.spans["block_tables"]
        return first + -(-count // 2)


@functools.lru_cache(maxsize=256)
def _layout(*sizes: int | bool) -> StepLayout:
    """One layout object per sizes, so that its spans are worked out once."""
    return StepLayout(*sizes)


@dataclass(frozen=True)
class StepInputs:
    """What one forward pass reads: the packed tokens and positions, the rows whose logits it
    returns (``SeqSlice.logits_rows``, increasing; as many as the batch has rows means all of
    them) and the step's attention metadata, all views of a :class:`StepBuffers` buffer. A new
    object per step, even over the same views: the metadata holds what the backend derives
    from the step's values (:meth:`AttentionMetadata.derived`)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [L] int64
    metadata: AttentionMetadata


class StepBuffers:
    """One device buffer of step inputs and its two host staging arrays.

    ``capacity``: the words to allocate at first. A growable buffer makes room for a larger
    step by allocating anew (earlier views keep the old memory); a fixed one (``growable=False``,
    the buffer CUDA graphs read) refuses a step that does not fit."""

    def __init__(self, device: torch.device, capacity: int = 0, growable: bool = True) -> None:
        self.device = torch.device(device)
        self.growable = growable
        self._pinned = self.device.type == "cuda"
        self._turn = 0
        self._allocate(max(capacity, 1))

    def _allocate(self, words: int) -> None:
        self.capacity = words
        self.buffer = torch.empty(words, dtype=torch.int64, device=self.device)
        self._staging = [torch.empty(words, dtype=torch.int64, pin_memory=self._pinned) for _ in range(2)]
        self._host = [staging.numpy() for staging in self._staging]
        self._views: dict[StepLayout, dict[str, torch.Tensor | None]] = {}  # of this buffer
        #: recorded after each staging array's last copy (an event never recorded counts as done)
        self._copied = [torch.cuda.Event() for _ in range(2)] if self._pinned else []

    def stage(self, arrays: StepArrays) -> StepInputs:
        """Send ``arrays`` to the device (one copy) and return the step's inputs over them."""
        return self.inputs(self.write(arrays), arrays.max_query_len, arrays.max_seq_len)

    def write(self, arrays: StepArrays) -> StepLayout:
        """Send ``arrays`` to the device with one copy into the buffer; returns their layout,
        whose :meth:`views` read them (views made earlier for the same layout read them too)."""
        layout = StepLayout.of(arrays)
        if layout.words > self.capacity:
            if not self.growable:
                raise ValueError(f"a step of {layout} needs {layout.words} words of a fixed {self.capacity}")
            self._allocate(max(layout.words, 2 * self.capacity))
        turn, self._turn = self._turn, 1 - self._turn
        if self._pinned and not self._copied[turn].query():
            self._copied[turn].synchronize()  # the last copy from this staging array is under way
        host = self._host[turn]
        for name, (first, count) in layout.spans.items():
            values = getattr(arrays, name)
            if count == 0:
                continue
            if name in INT64_FIELDS:
                host[first : first + count] = values
            else:
                host[first : first + -(-count // 2)].view(np.int32)[:count] = values.reshape(-1)
        words = layout.words
        self.buffer[:words].copy_(self._staging[turn][:words], non_blocking=self._pinned)
        if self._pinned:
            self._copied[turn].record()
        return layout

    def inputs(self, layout: StepLayout, max_query_len: int, max_seq_len: int) -> StepInputs:
        """The inputs of a step of ``layout`` written last (views of the device buffer, the same
        view objects for the same layout until the buffer grows), with a new metadata object;
        ``max_query_len`` and ``max_seq_len``: the host's bounds the metadata carries."""
        views = self._views.get(layout)
        if views is None:
            if len(self._views) >= KEPT_LAYOUTS:
                self._views.clear()
            views = self._views[layout] = self._make_views(layout)
        t = layout.num_tokens

        def metadata_of(group: int) -> AttentionMetadata:
            tables = views["block_tables"]
            return AttentionMetadata(
                slot_mapping=views["slot_mapping"][group * t : (group + 1) * t],
                block_tables=tables if layout.num_groups == 1 else tables[group],
                context_lens=views["context_lens"],
                cu_seqlens_q=views["cu_seqlens_q"],
                max_query_len=max_query_len,
                prompt_lens=views["prompt_lens"],
                max_seq_len=max_seq_len,
                num_actual_tokens=t,
                slots_padded=False,
            )

        metadata = metadata_of(0)
        if layout.num_groups > 1:
            metadata.groups = tuple([metadata, *map(metadata_of, range(1, layout.num_groups))])
        return StepInputs(views["input_ids"], views["positions"], views["logits_indices"], metadata)

    def _make_views(self, layout: StepLayout) -> dict[str, torch.Tensor | None]:
        tensors: dict[str, torch.Tensor | None] = {}
        for name, (first, count) in layout.spans.items():
            if name in INT64_FIELDS:
                tensors[name] = self.buffer[first : first + count]
            else:
                tensors[name] = self.buffer[first : first + -(-count // 2)].view(torch.int32)[:count]
        shape = (layout.num_seqs, layout.table_width)
        if layout.num_groups > 1:
            shape = (layout.num_groups, *shape)
        tensors["block_tables"] = tensors["block_tables"].view(shape)
        if not layout.has_prompt_lens:
            tensors["prompt_lens"] = None
        return tensors
