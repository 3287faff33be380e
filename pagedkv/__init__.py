"""pagedkv: an LLM inference engine built around a paged KV cache (PagedAttention).

``LLM`` and ``SamplingParams`` are imported on first use, so ``pagedkv simulate`` and
``pagedkv --help`` start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from pagedkv.engine import BeamSearchParams, RequestOutput, SamplingParams  # noqa: F401
    from pagedkv.llm import LLM  # noqa: F401

__version__ = "0.1.0"
EXPORTS = {
    "LLM": "pagedkv.llm",
    "BeamSearchParams": "pagedkv.engine.sampling_params",
    "RequestOutput": "pagedkv.engine.outputs",
    "SamplingParams": "pagedkv.engine.sampling_params",
}
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
