"""Requests in, tokens out: sampling parameters, scheduler, model runner, sampler, engine."""

from pagedkv.engine.engine import EngineConfig, InvalidRequestError, LLMEngine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import BeamSearchParams, SamplingParams

__all__ = [
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
