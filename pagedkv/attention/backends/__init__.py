"""Attention backends and how one is chosen.

Each backend computes the same paged decode and prefill attention; they differ only in speed.
``backend=None`` picks ``triton`` for CUDA tensors and ``cpu`` otherwise; the environment
variable ``PAGEDKV_ATTENTION_BACKEND`` overrides that default, and an explicit ``backend=``
argument overrides both. Backends are imported lazily, so importing pagedkv never imports triton.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV_VAR = "PAGEDKV_ATTENTION_BACKEND"

#: backend name -> module implementing ``decode(...)`` and ``prefill(...)``
BACKEND_MODULES: dict[str, str] = {
    "torch": "pagedkv.attention.backends.torch_backend",
    "cpu": "pagedkv.attention.backends.cpu",
    "triton": "pagedkv.attention.backends.triton_backend",
}


@dataclass(frozen=True)
class Backend:
    name: str
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]


def available_backends() -> list[str]:
    return list(BACKEND_MODULES)


def default_backend_name(device: torch.device) -> str:
    override = os.environ.get(ENV_VAR)
    if override:
        return override
    return "triton" if device.type == "cuda" else "cpu"


def get_backend(name: str | None, device: torch.device) -> Backend:
    """The backend called ``name`` (or the default for ``device``); a clear error if unknown."""
    name = default_backend_name(device) if name is None else name
    if name not in BACKEND_MODULES:
        source = f" (from ${ENV_VAR})" if os.environ.get(ENV_VAR) == name else ""
        raise ValueError(f"unknown attention backend {name!r}{source}; choose one of {available_backends()}")
    module = importlib.import_module(BACKEND_MODULES[name])
    return Backend(name=name, decode=module.decode, prefill=module.prefill)
