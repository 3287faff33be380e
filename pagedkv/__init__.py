"""pagedkv: an LLM inference engine built around a paged KV cache (PagedAttention).

``LLM`` and ``SamplingParams`` are imported on first use, so ``pagedkv simulate`` and
``pagedkv --help`` start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.engine import (
        BeamSearchParams,
        LoRARequest,
        RequestOutput,
        SamplingParams,
        StructuredOutputsParams,
    )
    from pagedkv.llm import LLM

__all__ = [
    "LLM",
    "BeamSearchParams",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagedkv.llm import LLM

        return LLM
    if name in (
        "SamplingParams",
        "RequestOutput",
        "BeamSearchParams",
        "StructuredOutputsParams",
        "LoRARequest",
    ):
        import pagedkv.engine

        return getattr(pagedkv.engine, name)
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
