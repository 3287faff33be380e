"""The paged KV cache and the kernels that read it: with the second tier's byte movers
(``memory/tier/``), the only code that touches KV tensors."""

from pagedkv.attention.backends import ENV_VAR as BACKEND_ENV_VAR
from pagedkv.attention.backends import Backend, available_backends, check_backend_reads, resolve_backend
from pagedkv.attention.checks import CHECK_ENV_VAR, check_step, per_call_checks, set_per_call_checks
from pagedkv.attention.kv_cache import KVCache, LayerKV
from pagedkv.attention.metadata import AttentionMetadata, AttentionOptions
from pagedkv.attention.ops import (
    attend,
    copy_blocks,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)
from pagedkv.attention.quant import KV_CACHE_DTYPES

__all__ = [
    "BACKEND_ENV_VAR",
    "CHECK_ENV_VAR",
    "AttentionMetadata",
    "AttentionOptions",
    "Backend",
    "KVCache",
    "KV_CACHE_DTYPES",
    "LayerKV",
    "attend",
    "available_backends",
    "check_backend_reads",
    "check_step",
    "copy_blocks",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "per_call_checks",
    "resolve_backend",
    "set_per_call_checks",
    "write_kv",
]
