"""Requests in, tokens out: sampling parameters, scheduler, model runner, sampler, engine."""

from pagedkv.engine.beam_search import BeamSearchParams
from pagedkv.engine.engine import EngineConfig, LLMEngine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.validation import InvalidRequestError, RequestLimits

__all__ = [
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "LLMEngine",
    "RequestLimits",
    "RequestOutput",
    "SamplingParams",
]
