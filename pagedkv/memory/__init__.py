"""The paging itself: blocks, block tables, prefix cache, KV byte sizes, and the second KV tier
(``tier/``). Importing it imports no torch: only the tier's byte movers (``tier/host.py``,
``tier/disk.py``, ``tier/movers.py``, ``tier/limits.py``) do, and only the executors import them."""

from pagedkv.memory.block_hash import ROOT_HASH_SEED, block_hash, salted_root
from pagedkv.memory.block_pool import BlockPool, KVCacheListener
from pagedkv.memory.block_table import BlockTable, blocks_for
from pagedkv.memory.errors import PoolExhaustedError
from pagedkv.memory.kv_bytes import GPT_STYLE_7B, KVSpec, parse_bytes
from pagedkv.memory.manager import KVCacheManager, KVUsage, PoolSnapshot, Preemption, TableSnapshot
from pagedkv.memory.prefix_cache import ROOT, PrefixCache, is_root, root_hash, root_of
from pagedkv.memory.tier.manager import PREEMPTION_MODES, TieredKVCacheManager, TierUsage
from pagedkv.memory.tier.slots import POOL_MEDIUM, TIER_MEDIUMS, KVTier, TierEvent
from pagedkv.memory.tier.transfers import BlockLoad, BlockSpill, KVTransfers, SwapCostModel, TransferReport

__all__ = [
    "GPT_STYLE_7B",
    "POOL_MEDIUM",
    "PREEMPTION_MODES",
    "ROOT",
    "ROOT_HASH_SEED",
    "TIER_MEDIUMS",
    "BlockLoad",
    "BlockPool",
    "BlockSpill",
    "BlockTable",
    "KVCacheListener",
    "KVCacheManager",
    "KVSpec",
    "KVTier",
    "KVTransfers",
    "KVUsage",
    "PoolExhaustedError",
    "PoolSnapshot",
    "Preemption",
    "PrefixCache",
    "SwapCostModel",
    "TableSnapshot",
    "TierEvent",
    "TierUsage",
    "TieredKVCacheManager",
    "TransferReport",
    "block_hash",
    "blocks_for",
    "is_root",
    "parse_bytes",
    "root_hash",
    "root_of",
    "salted_root",
]
