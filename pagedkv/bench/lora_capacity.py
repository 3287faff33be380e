"""What one memory budget holds with LoRA adapters: unified paging against fixed adapter slots.

Two ways to place adapter weights beside the KV cache in ``budget_bytes``:

* unified paging (S-LoRA's, :mod:`pagedkv.memory.adapter_pages`): one pool of
  ``budget_bytes // block_bytes`` blocks; an adapter takes ``adapter_pages`` of them while
  resident, a request ``ceil(context_len / block_size)``;
* fixed slots (vLLM's ``max_loras``): ``max_loras`` slots of ``slot_bytes`` (an adapter at
  ``max_lora_rank``) are reserved up front, whatever is served; the KV cache gets the rest, and
  at most ``max_loras`` adapters are resident.

Closed forms, no engine: ``pagedkv bench lora`` sets them beside what the engines measure.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.memory.block_table import blocks_for


@dataclass(frozen=True)
class Comparison:
    """One count under each placement."""

    unified: int
    slots: int


@dataclass(frozen=True)
class LoraBudget:
    """A memory budget and the sizes that divide it.

    ``block_bytes``: one KV block across all layers (keys, values); ``adapter_pages``: the blocks
    one adapter of the served rank takes under unified paging; ``slot_bytes``: one fixed slot.
    """

    budget_bytes: int
    block_bytes: int
    block_size: int
    adapter_pages: int
    slot_bytes: int
    max_loras: int

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "block_bytes", "block_size", "adapter_pages", "slot_bytes", "max_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LoraBudget.{name} must be a positive integer, got {value!r}")
        if self.slot_blocks < 0:
            raise ValueError(
                f"{self.max_loras} adapter slots of {self.slot_bytes} bytes exceed the budget of "
                f"{self.budget_bytes} bytes"
            )

    @property
    def pool_blocks(self) -> int:
        """Blocks of the unified pool: the whole budget."""
        return self.budget_bytes // self.block_bytes

    @property
    def slot_blocks(self) -> int:
        """KV blocks left beside the fixed slots (negative when the slots alone overflow)."""
        return (self.budget_bytes - self.max_loras * self.slot_bytes) // self.block_bytes

    def concurrent_requests(self, context_len: int, active_adapters: int) -> Comparison:
        """Requests of ``context_len`` tokens that run at once while ``active_adapters`` adapters
        are in use (fixed slots serve at most ``max_loras`` of them at a time)."""
        per_request = blocks_for(context_len, self.block_size)
        unified = (self.pool_blocks - active_adapters * self.adapter_pages) // per_request
        return Comparison(max(unified, 0), self.slot_blocks // per_request)

    def resident_adapters(self, context_len: int, requests: int) -> Comparison:
        """Adapters that stay resident beside ``requests`` requests of ``context_len`` tokens
        (0 where the requests' KV blocks alone do not fit)."""
        kv_blocks = requests * blocks_for(context_len, self.block_size)
        unified = (self.pool_blocks - kv_blocks) // self.adapter_pages
        slots = self.max_loras if kv_blocks <= self.slot_blocks else 0
        return Comparison(max(unified, 0), slots)
