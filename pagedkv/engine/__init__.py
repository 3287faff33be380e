"""Requests in, tokens out: sampling parameters, scheduler, executor, sampler, engine.

Names are imported on first use (:mod:`pagedkv.lazy_exports`), so the torch-free modules of
this package (``config``, ``kv_policy``) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig  # noqa: F401
    from pagedkv.engine.engine import LLMEngine  # noqa: F401
    from pagedkv.engine.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams  # noqa: F401
    from pagedkv.engine.validation import InvalidRequestError  # noqa: F401

EXPORTS = {
    "BeamSearchParams": "pagedkv.engine.sampling_params",
    "CompletionOutput": "pagedkv.engine.outputs",
    "EngineConfig": "pagedkv.engine.config",
    "InvalidRequestError": "pagedkv.engine.validation",
    "LLMEngine": "pagedkv.engine.engine",
    "RequestOutput": "pagedkv.engine.outputs",
    "SamplingParams": "pagedkv.engine.sampling_params",
}
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
