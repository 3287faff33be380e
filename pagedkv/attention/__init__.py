"""The only code that touches KV tensors: the paged cache and the kernels that read it."""

from pagedkv.attention.backends import ENV_VAR as BACKEND_ENV_VAR
from pagedkv.attention.backends import available_backends
from pagedkv.attention.kv_cache import KVCache, LayerKV
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.ops import (
    copy_blocks,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

__all__ = [
    "BACKEND_ENV_VAR",
    "AttentionMetadata",
    "KVCache",
    "LayerKV",
    "available_backends",
    "copy_blocks",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]
