"""Requests in, tokens out: sampling parameters, scheduler, executor, sampler, engine.

Everything here but ``LLMEngine`` is torch-free, so the command line can read the engine's
options, KV policies and request types without importing torch; ``LLMEngine`` (torch and the
model code) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.lora_request import LoRARequest
from pagedkv.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.engine.validation import InvalidRequestError, RequestLimits

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine

__all__ = [
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "LoRARequest",
    "RequestLimits",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TokenLogprobs",
]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from pagedkv.engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagedkv.engine' has no attribute {name!r}")
