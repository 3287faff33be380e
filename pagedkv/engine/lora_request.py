"""``LoRARequest``: which fine-tune of the base model a request runs with (vLLM's names).

A request without one runs the base model. The adapter is a PEFT folder
(``adapter_config.json`` and ``adapter_model.safetensors``), read when the request is added
(:mod:`pagedkv.models.lora_checkpoint` checks it against the model) and loaded into one of the
engine's adapter slots while requests of it run (:mod:`pagedkv.memory.adapters`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by its name (what the server's ``model`` field names), a positive id unique
    per adapter (vLLM's ``lora_int_id``) and the folder it is read from."""

    lora_name: str
    lora_int_id: int
    lora_path: str | Path

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        lora_id = self.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, numbers.Integral) or lora_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {lora_id!r}")
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise ValueError(f"lora_path must be a folder path, got {self.lora_path!r}")

    @property
    def path(self) -> Path:
        return Path(self.lora_path)
