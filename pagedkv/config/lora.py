"""The LoRA part of the engine's settings: how many adapters share a step, the largest rank one
may have (vLLM's ``LoRAConfig``), and where resident adapters' weights live."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.config.checks import positive_int

#: The largest ``max_lora_rank``: the slot tensors of every targeted projection are padded to
#: the rank limit, so it sizes the memory and the work of every adapter row.
MAX_LORA_RANK_LIMIT = 64
#: Where resident adapters' weights live: ``unified`` -- in pages of the KV block pool, counted at
#: admission beside the KV blocks and evicted after cached-free ones (S-LoRA's unified paging);
#: ``slots`` -- only in the ``max_loras`` compute slots (vLLM's), the pool holding KV alone.
LORA_PAGING = ("unified", "slots")


@dataclass(frozen=True)
class LoRAConfig:
    """Checked when made; an engine without ``enable_lora`` has none (``EngineSettings.lora``)."""

    #: Adapters held in the model's slot tensors at once: rows of at most this many adapters
    #: (and base rows) share a step; an adapter beyond them waits for an idle one to be evicted.
    max_loras: int
    #: The largest rank an adapter may have; smaller ones are zero-padded to it.
    max_lora_rank: int
    #: One of :data:`LORA_PAGING`.
    lora_paging: str = "unified"

    def __post_init__(self) -> None:
        positive_int("max_loras", self.max_loras)
        rank = positive_int("max_lora_rank", self.max_lora_rank)
        if rank > MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK_LIMIT}, got {rank}")
        if self.lora_paging not in LORA_PAGING:
            raise ValueError(f"lora_paging must be one of {LORA_PAGING}, got {self.lora_paging!r}")

    @property
    def unified_paging(self) -> bool:
        """Adapters' weights take pages of the KV block pool."""
        return self.lora_paging == "unified"
