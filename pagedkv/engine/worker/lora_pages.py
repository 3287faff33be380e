"""The worker's half of unified LoRA paging: adapters' weights written into their pages of the
KV cache, and the model's slots pointed at those pages.

The plan says which adapters were loaded into which pages (:class:`~pagedkv.memory.adapters.PageWrite`):
the folder is read once, its weights file checked against the CRC-32 taken when the adapter was
added (an evicted adapter is read again later, and must be the same adapter), and its ``A`` and
``B`` written into the pages (:func:`~pagedkv.attention.adapter_slabs.write_adapter`). A slot load
that names pages (:attr:`~pagedkv.memory.adapters.SlotLoad.pages`) then points the slot at them:
with :class:`~pagedkv.models.lora_paged.PagedLoRA` (rows that fit a KV chunk) the slot's offset
tables are rebuilt from the layout and the pages, so the forward pass reads the adapter where it
is; with :class:`~pagedkv.models.lora.LoRASlots` (a model whose rows do not fit) every layer is
gathered back, bit-exact, and put into the slot's tensors. An adapter written again into other
pages (after an eviction) is pointed at them at once: offsets are always the last write's.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from pagedkv.attention.adapter_slabs import (
    check_unified_paging,
    chunk_index,
    gather_adapter_layer,
    row_offsets,
    write_adapter,
)
from pagedkv.attention.kv_cache import KVCache
from pagedkv.memory.adapter_layout import AdapterLayout, chunk_elements
from pagedkv.memory.adapters import PageWrite, SlotLoad
from pagedkv.models.lora import LoRAModules, LoRASlots
from pagedkv.models.lora_checkpoint import TARGETS, LoRAAdapterError, read_adapter
from pagedkv.models.lora_paged import PagedLoRA, rows_fit

logger = logging.getLogger(__name__)


def reads_pages(model: Any, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the forward pass reads ``model``'s adapters in their pages of a KV cache of
    these sizes (:class:`~pagedkv.models.lora_paged.PagedLoRA`); when a projection's rows do
    not fit a KV chunk it computes from slots filled from the pages, and says why."""
    why = rows_fit(model.config, chunk_elements(block_size, num_kv_heads, head_dim))
    if why is not None:
        logger.warning("LoRA adapters are paged, but computed from slots filled from their pages: %s", why)
    return why is None


class PagedAdapterWeights:
    """Where each written adapter's weights sit in ``kv_cache``: its pages, their layout and its
    scaling, as of the last write (pages reused by KV since are never read: the control plane
    loads an evicted adapter anew, which writes it anew); and which slot of ``lora`` (the
    model's) each adapter was last loaded into."""

    def __init__(self, kv_cache: KVCache, model_config: Any, max_rank: int, lora: LoRAModules) -> None:
        check_unified_paging(kv_cache)
        self.kv_cache = kv_cache
        self.model_config = model_config
        self.max_rank = max_rank
        self.lora = lora
        self._written: dict[int, tuple[tuple[int, ...], AdapterLayout, float]] = {}
        self._slot_of: dict[int, int] = {}

    def write(self, page_write: PageWrite) -> None:
        """Read the adapter's folder (checked) and write its weights into its pages."""
        self._unpoint(page_write.lora_int_id)  # its old pages may hold KV by now
        spec = read_adapter(page_write.path, self.model_config, self.max_rank)
        data = Path(spec.weights_file).read_bytes()
        if zlib.crc32(data) != page_write.checksum:
            raise LoRAAdapterError(
                f"{spec.weights_file}: the file changed since the adapter was added (its CRC-32 differs); "
                "add it again under a new id"
            )
        tensors = load_safetensors(data)
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(self.kv_cache.num_layers)
        ]
        for (layer, shard), (a, b) in spec.tensors.items():
            layers[layer][shard] = (tensors[a], tensors[b])
        layout = write_adapter(self.kv_cache, page_write.block_ids, layers)
        self._written[page_write.lora_int_id] = (tuple(page_write.block_ids), layout, spec.scaling)
        self._repoint(page_write.lora_int_id)

    def place(self, load: SlotLoad) -> None:
        """Slot ``load.slot`` at the adapter's pages, which a write put there."""
        written = self._written.get(load.lora_int_id)
        if written is None or written[0] != tuple(load.pages):
            raise RuntimeError(
                f"LoRA adapter {load.lora_name!r} was not written into pages {list(load.pages)} "
                "before its slot load (a plan was lost)"
            )
        self._slot_of = {lora_id: slot for lora_id, slot in self._slot_of.items() if slot != load.slot}
        self._slot_of[load.lora_int_id] = load.slot
        if isinstance(self.lora, PagedLoRA):
            self._repoint(load.lora_int_id)
        else:
            self._fill(self.lora, load.slot, *written)

    def _repoint(self, lora_int_id: int) -> None:
        """The adapter's slot (if any) at its pages of the last write (paged form only)."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None or not isinstance(self.lora, PagedLoRA):
            return
        block_ids, layout, scaling = self._written[lora_int_id]
        self.lora.point(slot, row_offsets(self.kv_cache, block_ids, layout), scaling)

    def _unpoint(self, lora_int_id: int) -> None:
        slot = self._slot_of.get(lora_int_id)
        if slot is not None and isinstance(self.lora, PagedLoRA):
            self.lora.clear(slot)

    def _fill(
        self, slots: LoRASlots, slot: int, block_ids: tuple[int, ...], layout: AdapterLayout, scaling: float
    ) -> None:
        """Slot ``slot``'s tensors from the adapter's pages, every layer gathered first."""
        index = chunk_index(self.kv_cache, block_ids)
        layers = [gather_adapter_layer(self.kv_cache, index, layout, i) for i in range(layout.num_layers)]
        slots.clear(slot)
        for layer, targets in enumerate(layers):
            for shard, (a, b) in targets.items():
                slots.modules[layer, TARGETS[shard]].put(slot, shard, a, b)
        slots.scaling[slot] = scaling
