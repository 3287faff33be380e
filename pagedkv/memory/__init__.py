"""The paging itself: blocks, block tables, prefix cache. Pure Python, no torch import."""

from pagedkv.memory.block_pool import BlockPool, KVCacheListener
from pagedkv.memory.block_table import BlockTable, blocks_for
from pagedkv.memory.errors import PoolExhaustedError
from pagedkv.memory.manager import KVCacheManager, KVUsage, PoolSnapshot, TableSnapshot
from pagedkv.memory.prefix_cache import ROOT, PrefixCache
from pagedkv.memory.spec import GPT_STYLE_7B, KVSpec, parse_bytes

__all__ = [
    "GPT_STYLE_7B",
    "ROOT",
    "BlockPool",
    "BlockTable",
    "KVCacheListener",
    "KVCacheManager",
    "KVSpec",
    "KVUsage",
    "PoolExhaustedError",
    "PoolSnapshot",
    "PrefixCache",
    "TableSnapshot",
    "blocks_for",
    "parse_bytes",
]
