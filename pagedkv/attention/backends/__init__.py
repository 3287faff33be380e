"""Attention backends and how one is chosen.

Each backend computes the same paged decode and prefill attention; they differ only in speed.
``None`` picks ``triton`` for CUDA tensors and ``cpu`` otherwise; the environment variable
``PAGEDKV_ATTENTION_BACKEND`` overrides that default, and an explicit name overrides both. The
model resolves its backend once, when it is built (:func:`resolve_backend`), and every layer
calls that :class:`Backend`'s functions directly. Importing a backend module is cheap: the
``triton`` backend imports triton only when it first launches its kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.attention.backends import cpu, torch_backend, triton_backend
from pagedkv.attention.kv_cache import LayerKV
from pagedkv.attention.metadata import AttentionMetadata, AttentionOptions
from pagedkv.attention.quant import check_kv_cache_dtype

ENV_VAR = "PAGEDKV_ATTENTION_BACKEND"

#: ``(q, layer, metadata, options) -> out``: every backend's decode and prefill.
Kernel = Callable[[torch.Tensor, LayerKV, AttentionMetadata, AttentionOptions], torch.Tensor]


@dataclass(frozen=True)
class Backend:
    name: str
    decode: Kernel
    prefill: Kernel
    #: the ``kv_cache_dtype`` values whose blocks this backend reads
    kv_cache_dtypes: tuple[str, ...]


BACKENDS: dict[str, Backend] = {
    module_name: Backend(module_name, module.decode, module.prefill, module.KV_CACHE_DTYPES)
    for module_name, module in (("torch", torch_backend), ("cpu", cpu), ("triton", triton_backend))
}


def available_backends() -> list[str]:
    return list(BACKENDS)


def default_backend_name(device: torch.device) -> str:
    override = os.environ.get(ENV_VAR)
    if override:
        return override
    return "triton" if device.type == "cuda" else "cpu"


def resolve_backend(backend: str | Backend | None, device: torch.device) -> Backend:
    """The backend called ``backend`` (or the default for ``device``); a clear error if unknown.
    A :class:`Backend` passes through, so a layer holding one pays nothing per call."""
    if isinstance(backend, Backend):
        return backend
    name = default_backend_name(device) if backend is None else backend
    if name not in BACKENDS:
        source = f" (from ${ENV_VAR})" if os.environ.get(ENV_VAR) == name else ""
        raise ValueError(f"unknown attention backend {name!r}{source}; choose one of {available_backends()}")
    return BACKENDS[name]


def check_backend_reads(backend: str | None, device: torch.device | str, kv_cache_dtype: str) -> Backend:
    """The backend a model on ``device`` will use, after checking that ``kv_cache_dtype`` is known
    and that this backend reads such blocks: called before any memory is allocated, so a bad
    combination fails at once with a message that says what to choose instead."""
    check_kv_cache_dtype(kv_cache_dtype)
    chosen = resolve_backend(backend, torch.device(device))
    if kv_cache_dtype not in chosen.kv_cache_dtypes:
        readers = [b.name for b in BACKENDS.values() if kv_cache_dtype in b.kv_cache_dtypes]
        raise ValueError(
            f"the {chosen.name!r} attention backend cannot read kv_cache_dtype={kv_cache_dtype!r} blocks "
            f"(it reads {list(chosen.kv_cache_dtypes)}); use kv_cache_dtype='auto' or one of the "
            f"backends {readers}"
        )
    return chosen
