"""pagedkv: an LLM inference engine built around a paged KV cache (PagedAttention)."""

from pagedkv.engine import RequestOutput, SamplingParams
from pagedkv.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
