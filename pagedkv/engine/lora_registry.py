"""The LoRA adapters an engine knows: each checked once against the model when it is added
(vLLM's ``add_lora`` / ``remove_lora`` / ``list_loras``), so a request naming a known adapter
costs no file read, and a bad adapter is refused with its reason before any request of it
takes engine state. Which adapters are resident in the model's slots is the scheduler's
(:mod:`pagedkv.memory.adapters`)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from pagedkv.config.lora import LoRAConfig
from pagedkv.engine.core.adapter_paging import AdapterFile
from pagedkv.engine.lora_request import LoRARequest
from pagedkv.engine.validation import InvalidRequestError
from pagedkv.memory.adapter_layout import AdapterLayout, chunk_elements
from pagedkv.models.lora_checkpoint import AdapterSpec, LoRAAdapterError, layer_shapes, read_adapter


class LoRARegistry:
    """Adapters by id, each with its checked :class:`AdapterSpec`; None config: LoRA is off and
    every adapter is refused."""

    def __init__(self, config: LoRAConfig | None, model_config: Any) -> None:
        self.config = config
        self.model_config = model_config
        self._adapters: dict[int, tuple[LoRARequest, AdapterSpec]] = {}

    def add(self, lora: LoRARequest) -> bool:
        """Check and register ``lora``; False if it was known already. An id or a name that is
        another adapter's is refused, as is a folder that cannot serve this model."""
        if self.config is None:
            raise InvalidRequestError(
                "LoRA adapters are not enabled: start the engine with enable_lora=True (--enable-lora)",
                param="lora_request",
            )
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        known = self._adapters.get(lora.lora_int_id)
        if known is not None:
            if known[0] != lora:
                raise InvalidRequestError(
                    f"lora_int_id {lora.lora_int_id} is adapter {known[0].lora_name!r} from "
                    f"{str(known[0].lora_path)!r} already",
                    param="lora_request",
                )
            return False
        if any(other.lora_name == lora.lora_name for other, _ in self._adapters.values()):
            raise InvalidRequestError(
                f"a LoRA adapter named {lora.lora_name!r} is loaded already", "lora_request"
            )
        try:
            spec = read_adapter(lora.path, self.model_config, self.config.max_lora_rank)
        except LoRAAdapterError as err:
            raise InvalidRequestError(str(err), param="lora_request") from None
        self._adapters[lora.lora_int_id] = (lora, spec)
        return True

    def paged_file(self, lora_int_id: int, block_size: int, num_kv_heads: int, head_dim: int) -> AdapterFile:
        """What unified paging needs of a known adapter: its folder, the pages its weights take
        in a KV cache of these block sizes (:class:`~pagedkv.memory.adapter_layout.AdapterLayout`,
        from the checked header's shapes), and the CRC-32 of its weights file, which the worker
        checks each time it reads the file into the pages (an evicted adapter is read again)."""
        lora, spec = self._adapters[lora_int_id]
        layers = layer_shapes(spec, self.model_config)
        pages = AdapterLayout.of(layers, chunk_elements(block_size, num_kv_heads, head_dim)).pages
        return AdapterFile(lora.lora_name, str(lora.lora_path), pages, weights_checksum(spec.weights_file))

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it was not known."""
        return self._adapters.pop(lora_int_id, None) is not None

    def list(self) -> list[LoRARequest]:
        """The known adapters, in the order they were added."""
        return [lora for lora, _ in self._adapters.values()]


def weights_checksum(file: Path) -> int:
    """The CRC-32 of an adapter's weights file (read in 1 MiB pieces)."""
    crc = 0
    with open(file, "rb") as f:
        while piece := f.read(1 << 20):
            crc = zlib.crc32(piece, crc)
    return crc
