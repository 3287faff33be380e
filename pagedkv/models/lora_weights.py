"""Where one adaptable projection's LoRA weights are, and the adapters' outputs computed from
there (Punica's BGMV: each row times its own adapter only).

Two forms, one per residency design:

* :class:`SlotWeights` -- slot tensors ``a [slots, shards * rank, in]`` and ``b [slots, shards *
  rank, out]`` (``B`` transposed), each slot holding one adapter zero-padded to the slots' rank
  (:mod:`pagedkv.models.lora`: ``lora_paging="slots"`` and tensor parallelism);
* :class:`PagedWeights` -- the adapters' rows where their one copy lives, in pages of the KV
  cache, found through a table of element offsets ``[slots, 2, shards * rank]`` (A's rows, then
  B's; -1 for a smaller rank's padding) that the worker rewrites each time an adapter is written
  into its pages (:mod:`pagedkv.models.lora_paged`, unified paging).

On the CPU both are one call of the C kernel (:mod:`pagedkv.kernels.lora_bgmv`), the same sums in
the same order. On CUDA both are the Triton shrink/expand pair of the slot form's contract
(:mod:`pagedkv.kernels.triton_lora`): the pages are first gathered, only the step's adapters'
rows, into transient slot tensors, each row's slot renumbered to its adapter's place among them.
Elsewhere (float16 on the CPU, no kernels library, no triton) the slots are two dense products
over every slot, each row's products of other slots zeroed by its scale; the pages are gathered
as on CUDA, then the same products. No path synchronises with the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import Tensor

from pagedkv.kernels import lora_bgmv, triton_kernels


def _scale(
    slot: torch.Tensor, scaling: torch.Tensor, adapters: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[T, len(adapters), 1]``: each row's scaling at its own adapter's index, zero elsewhere."""
    scale = (slot.unsqueeze(1) == adapters).to(dtype).mul_(scaling.index_select(0, adapters).to(dtype))
    return scale.unsqueeze(2)


def _kernel(x: Tensor, held: Tensor, out: Tensor) -> ModuleType | None:
    """The BGMV kernels that run rows ``x`` on adapter weights held in ``held`` (slot tensors or
    the KV cache): the C kernel on the CPU, the Triton pair on CUDA; None: torch."""
    if not out.is_contiguous():
        return None
    kernel = lora_bgmv if x.device.type == "cpu" else triton_kernels("triton_lora")
    return kernel if kernel is not None and kernel.takes(x, held) else None


@dataclass(frozen=True, eq=False)
class SlotWeights:
    """A projection's slot tensors; block ``p`` of ``rank`` rows writes the output columns
    ``columns[p]:columns[p + 1]``."""

    a: torch.Tensor
    b: torch.Tensor
    columns: torch.Tensor

    @property
    def slots(self) -> int:
        return self.a.shape[0]

    def add(self, x: Tensor, slot: Tensor, scaling: Tensor, adapters: Tensor | None, out: Tensor) -> Tensor:
        """``out [T, out]`` plus each row's adapter output for ``x [T, in]`` (in place where it
        can); ``slot [T]`` each row's slot (-1: none), ``scaling [slots]``."""
        a, b = self.a, self.b
        kernel = _kernel(x, a, out)
        if kernel is not None:
            return kernel.lora_bgmv(x, a, b, slot, scaling, self.columns, out)
        slots, rank = a.shape[0], a.shape[1]
        every = torch.arange(slots, device=slot.device)
        low = torch.mm(x, a.reshape(slots * rank, -1).t()).view(-1, slots, rank)
        low.mul_(_scale(slot, scaling, every, x.dtype))
        return out.add_(torch.mm(low.view(-1, slots * rank), b.reshape(slots * rank, -1)))


@dataclass(frozen=True, eq=False)
class PagedWeights:
    """A projection's adapters in pages of the KV cache tensor ``base``: ``offsets [slots, 2,
    shards * rank]`` (int64, -1: a zero row), ``n_in`` its input features, block ``p`` of
    ``rank`` rows writing the output columns ``columns[p]:columns[p + 1]``, its ``B`` rows that
    many elements long."""

    base: torch.Tensor
    offsets: torch.Tensor
    columns: torch.Tensor
    n_in: int
    bounds: tuple[int, ...] = field(init=False, repr=False)
    #: ``columns`` on the cache's device, where the Triton kernels read them
    device_columns: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bounds", tuple(int(c) for c in self.columns))
        object.__setattr__(self, "device_columns", self.columns.to(self.base.device))

    @property
    def slots(self) -> int:
        return self.offsets.shape[0]

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def rank(self) -> int:
        return self.offsets.shape[2] // self.shards

    def add(self, x: Tensor, slot: Tensor, scaling: Tensor, adapters: Tensor | None, out: Tensor) -> Tensor:
        """As :meth:`SlotWeights.add`; ``adapters``: the step's distinct slots (int64), which
        the torch form gathers (every other slot's offsets may point at reused pages)."""
        kernel = _kernel(x, self.base, out)
        if kernel is lora_bgmv:
            return lora_bgmv.lora_bgmv_paged(x, self.base, self.offsets, slot, scaling, self.columns, out)
        if adapters is None:
            raise ValueError("paged LoRA weights off the C kernel need the step's adapters")
        if kernel is not None:  # the Triton pair, on the step's adapters gathered as slots
            return kernel.lora_bgmv(x, *self.slot_form(slot, scaling, adapters), self.device_columns, out)
        flat, rank = self.base.view(-1), self.rank
        table = self.offsets.index_select(0, adapters)
        n = adapters.shape[0]
        a = _gathered(flat, table[:, 0], self.n_in)  # [n, shards * rank, in]
        low = torch.mm(x, a.view(n * a.shape[1], -1).t()).view(-1, n, a.shape[1])
        low.mul_(_scale(slot, scaling, adapters, x.dtype))
        for p in range(self.shards):
            first, end = self.bounds[p], self.bounds[p + 1]
            b = _gathered(flat, table[:, 1, p * rank : (p + 1) * rank], end - first)  # [n, rank, width]
            delta = torch.mm(low[:, :, p * rank : (p + 1) * rank].reshape(-1, n * rank), b.view(n * rank, -1))
            out[:, first:end].add_(delta)
        return out

    def slot_form(
        self, slot: Tensor, scaling: Tensor, adapters: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The step's ``adapters`` (int64, increasing) as the slot form's arguments: ``a [n,
        shards * rank, in]`` and ``b [n, shards * rank, out]`` gathered from the pages (slot ``i``
        holding ``adapters[i]``, ``B`` zero outside each block's columns), each row's ``slot``
        renumbered to its adapter's place (int32, -1 kept) and those slots' scalings."""
        flat, rank, n = self.base.view(-1), self.rank, adapters.shape[0]
        table = self.offsets.index_select(0, adapters)
        a = _gathered(flat, table[:, 0], self.n_in)
        b = a.new_zeros((n, a.shape[1], self.bounds[-1]))
        for p in range(self.shards):
            first, end = self.bounds[p], self.bounds[p + 1]
            b[:, p * rank : (p + 1) * rank, first:end] = _gathered(
                flat, table[:, 1, p * rank : (p + 1) * rank], end - first
            )
        renumbered = torch.where(slot >= 0, torch.searchsorted(adapters, slot.long()), -1).int()
        return a, b, renumbered, scaling.index_select(0, adapters)


def _gathered(flat: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """The rows of ``width`` elements at ``offsets`` of ``flat`` (one index_select), a negative
    offset's row zero: ``[*offsets.shape, width]``."""
    at = offsets.clamp(min=0).unsqueeze(-1) + torch.arange(width, device=flat.device)
    rows = flat.index_select(0, at.view(-1)).view(*offsets.shape, width)
    return rows.masked_fill_((offsets < 0).unsqueeze(-1), 0)


#: a projection's adapter weights, in either form
LoRAWeights = SlotWeights | PagedWeights
