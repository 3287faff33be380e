"""Which LoRA adapters are resident, in which of the model's adapter slots: the control plane's
side of multi-LoRA, plain Python.

The model holds ``num_slots`` adapters' weights at once (vLLM's ``max_loras``; the tensors are
:mod:`pagedkv.models.lora`'s). An adapter is *in use* while a running sequence runs with it, and
only an adapter not in use may lose its slot: the scheduler admits a sequence of an adapter
that is not resident only when a slot is free or an idle adapter can be evicted, least recently
admitted first (S-LoRA's and vLLM's LRU). Each placement is a :class:`SlotLoad` the next plan
carries, so the workers read the adapter's tensors into the slot before that step's forward pass.

Invariants: an adapter holds at most one slot and a slot at most one adapter; the slots held
plus the free ones are exactly ``range(num_slots)``; an adapter named in ``in_use`` is never
evicted. Being in use is not counted here but passed in by the caller (the adapters of the
running sequences), so no release can be missed and no count can leak.

Without unified paging the slots are the model's slot tensors, each sized for the largest rank.
With it an adapter's weights live once, in pages of the KV block pool
(:mod:`pagedkv.memory.adapter_pages`), which decide what stays resident; a slot is then only
which of the step's adapters a row runs with, pointed at the adapter's pages
(:attr:`SlotLoad.pages`) -- ``num_slots`` stays vLLM's limit of distinct adapters in one step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotLoad:
    """Read adapter ``lora_int_id`` (named ``lora_name``, from the folder ``path``) into slot
    ``slot`` before the step's forward pass. Plain data: it travels in the step plan."""

    slot: int
    lora_int_id: int
    lora_name: str
    path: str
    #: The adapter's pages in the KV block pool, whose weights the worker wrote there: the slot
    #: is pointed at them. Empty: the slot is read from the folder (no unified paging).
    pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class PageWrite:
    """Write adapter ``lora_int_id``'s weights, read from the folder ``path`` and checked against
    ``checksum`` (the CRC-32 of its weights file when the adapter was added), into its pages
    ``block_ids`` of the KV cache, after the step's tier moves and block copies and before its
    slot loads and forward pass. Plain data: it travels in the step plan."""

    lora_int_id: int
    path: str
    checksum: int
    block_ids: tuple[int, ...]
    #: The step's tier loads copy the adapter's pages back from the second KV tier, where its
    #: last eviction spilled them; the folder is read only if they fail their check.
    from_tier: bool = False


class AdapterResidency:
    """The adapter slots' owners (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        #: adapter id -> slot, least recently admitted first
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._loads: list[SlotLoad] = []
        #: Adapters placed and evicted since the engine started.
        self.loads = 0
        self.evictions = 0

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

    def slots(self) -> dict[int, int]:
        """adapter id -> slot of every resident adapter (a copy)."""
        return dict(self._slot_of)

    def place(self, lora_int_id: int, lora_name: str, path: str, in_use: Collection[int]) -> int | None:
        """The slot of adapter ``lora_int_id``, placing it when it is not resident: into a free
        slot, else the slot of the least recently placed adapter not in ``in_use`` (evicted).
        None: every slot holds an adapter in use, so the caller's sequence waits."""
        slot = self._slot_of.get(lora_int_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_int_id)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((a for a in self._slot_of if a not in in_use), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            self.evictions += 1
        self._slot_of[lora_int_id] = slot
        self._loads.append(SlotLoad(slot, lora_int_id, lora_name, path))
        self.loads += 1
        return slot

    def can_place(self, lora_int_id: int, in_use: Collection[int]) -> bool:
        """Whether :meth:`place` would find ``lora_int_id`` a slot now."""
        if lora_int_id in self._slot_of or self._free:
            return True
        return any(a not in in_use for a in self._slot_of)

    def forget(self, lora_int_id: int, in_use: Collection[int]) -> bool:
        """Free the slot of an adapter being unloaded; False (kept) while it is in use."""
        if lora_int_id in in_use:
            return False
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free.append(slot)
            self._loads = [load for load in self._loads if load.lora_int_id != lora_int_id]
        return True

    def undo(self, loads: list[SlotLoad]) -> None:
        """Forget placements whose loads failed (the step that carried them did not run): their
        slots are free again, and a later request of the adapter loads it anew."""
        for load in loads:
            if self._slot_of.get(load.lora_int_id) == load.slot:
                del self._slot_of[load.lora_int_id]
                self._free.append(load.slot)

    def take_loads(self) -> list[SlotLoad]:
        """The placements since the last call, in order (the next plan's)."""
        loads, self._loads = self._loads, []
        return loads
