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
pages (after an eviction, from its folder or from the tier) is pointed at them at once: the
offsets are always the last write's, never left at pages KV blocks may hold by now.

A write marked ``from_tier`` reads nothing: the step's tier loads, which ran before it, copied
the adapter's pages back from the second KV tier where its eviction spilled them. They are used
only if every page's load passed the tier's own check (a disk file's CRC-32) and the pages'
bytes have the CRC-32 they had when this process wrote them from the folder (a host tier's RAM
has no check of its own); otherwise the reason is logged, the tier told the copy is bad (it
forgets it), and the folder is read as without a tier -- in the same step.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as load_safetensors

from pagedkv.attention.adapter_slabs import (
    cache_chunk_elements,
    check_unified_paging,
    chunk_index,
    gather_adapter_layer,
    pages_checksum,
    row_offsets,
    write_adapter,
)
from pagedkv.attention.kv_cache import KVCache
from pagedkv.log_limits import ThrottledLog
from pagedkv.memory.adapter_layout import AdapterLayout, chunk_elements
from pagedkv.memory.adapters import PageWrite, SlotLoad
from pagedkv.models.lora import LoRAModules, LoRASlots
from pagedkv.models.lora_checkpoint import TARGETS, LoRAAdapterError, layer_shapes, read_adapter
from pagedkv.models.lora_paged import PagedLoRA, rows_fit

logger = logging.getLogger("pagedkv.engine.worker.lora_pages")


def reads_pages(model: Any, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether the forward pass reads ``model``'s adapters in their pages of a KV cache of
    these sizes (:class:`~pagedkv.models.lora_paged.PagedLoRA`); when a projection's rows do
    not fit a KV chunk it computes from slots filled from the pages, and says why."""
    why = rows_fit(model.config, chunk_elements(block_size, num_kv_heads, head_dim))
    if why is not None:
        logger.warning("LoRA adapters are paged, but computed from slots filled from their pages: %s", why)
    return why is None


class TierLoads(Protocol):
    """What of a rank's second tier (``executor/tier_io.RankTier``) a write reads: whether the
    step's loads into some blocks passed the tier's check, and a way to report them bad."""

    def loaded(self, block_ids: tuple[int, ...]) -> bool: ...

    def reject(self, block_ids: tuple[int, ...]) -> None: ...


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
        #: (adapter id, weights file CRC-32) -> its pages' CRC-32 as written from it, its layout
        #: and scaling: what a copy of those pages brought back from the tier is checked against
        self._page_crc: dict[tuple[int, int], tuple[int, AdapterLayout, float]] = {}
        self._log = ThrottledLog(logger, "LoRA tier")

    def write(self, page_write: PageWrite, tier: TierLoads | None = None) -> None:
        """The adapter's weights into its pages: kept as ``tier``'s loads copied them when the
        plan says so and they pass their checks, else read from the folder (checked); then its
        slot, if it holds one, pointed at them."""
        self._unpoint(page_write.lora_int_id)  # its old pages may hold KV by now
        self._keep_or_read(page_write, tier)
        self._repoint(page_write.lora_int_id)

    def _keep_or_read(self, page_write: PageWrite, tier: TierLoads | None) -> None:
        if page_write.from_tier:
            fault = self._tier_fault(page_write, tier)
            if fault is None:
                return
            if tier is not None:
                tier.reject(page_write.block_ids)
            self._log.warning(
                "fallback",
                "adapters read from their folders instead",
                "LoRA adapter %d: not using its copy from the KV tier (%s); reading %s",
                page_write.lora_int_id,
                fault,
                page_write.path,
            )
        self._write_from_folder(page_write)

    def _tier_fault(self, page_write: PageWrite, tier: TierLoads | None) -> str | None:
        """Why the pages the tier loaded cannot be used (None: they can), and the adapter's
        layout and scaling recorded for them."""
        if tier is None or not tier.loaded(page_write.block_ids):
            return "a page failed the tier's check or was not loaded"
        known = self._page_crc.get((page_write.lora_int_id, page_write.checksum))
        if known is not None:
            crc, layout, scaling = known
            if pages_checksum(self.kv_cache, page_write.block_ids) != crc:
                return "its pages' CRC-32 differs from the one they were written with"
        else:  # written by an earlier process (a disk tier): the file's check is the tier's
            spec = read_adapter(page_write.path, self.model_config, self.max_rank)
            shapes = layer_shapes(spec, self.model_config)
            layout, scaling = AdapterLayout.of(shapes, cache_chunk_elements(self.kv_cache)), spec.scaling
        self._written[page_write.lora_int_id] = (tuple(page_write.block_ids), layout, scaling)
        return None

    def _write_from_folder(self, page_write: PageWrite) -> None:
        """Read the adapter's folder (checked) and write its weights into its pages."""
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
        if isinstance(self.lora, PagedLoRA):  # read in place: B's rows in the model's order
            layers = self.lora.in_model_order(layers)
        layout = write_adapter(self.kv_cache, page_write.block_ids, layers)
        self._written[page_write.lora_int_id] = (tuple(page_write.block_ids), layout, spec.scaling)
        crc = pages_checksum(self.kv_cache, page_write.block_ids)
        self._page_crc[page_write.lora_int_id, page_write.checksum] = (crc, layout, spec.scaling)

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
