"""Requests in, tokens out: sampling parameters, scheduler, executor, sampler, engine.

Names are imported on first use, so the torch-free modules of this package (``config``,
``kv_policy``) can be imported by the command line without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.engine.engine import EngineConfig, InvalidRequestError, LLMEngine  # noqa: F401
    from pagedkv.engine.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams  # noqa: F401

_EXPORTS = {
    "BeamSearchParams": "pagedkv.engine.sampling_params",
    "CompletionOutput": "pagedkv.engine.outputs",
    "EngineConfig": "pagedkv.engine.engine",
    "InvalidRequestError": "pagedkv.engine.engine",
    "LLMEngine": "pagedkv.engine.engine",
    "RequestOutput": "pagedkv.engine.outputs",
    "SamplingParams": "pagedkv.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedkv.engine' has no attribute {name!r}")
