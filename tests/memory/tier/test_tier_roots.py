"""A block keeps the root of its chain when it moves to the second tier, so its KV events can name
the tenant or LoRA adapter whose request made it: spilled from the pool, and indexed again by a
restarted disk tier in any order. An adapter's own pages in the tier announce nothing."""

from pagedkv.memory import ROOT, KVTier, TieredKVCacheManager, block_hash, root_of
from pagedkv.memory.block_hash import chain_hashes
from pagedkv.memory.tier.adapter_entries import page_entry
from pagedkv.memory.tier.slots import ADAPTER_PAGE_PARENT

BS = 4
SALT = "\x00lora\x007\x00tuned\x00/adapters/tuned\x00"  # a LoRA adapter's prefix salt (Request.prefix_salt)


def test_spilled_blocks_keep_their_chains_root():
    kv = TieredKVCacheManager(3, BS, KVTier(8), 1000, watermark=0.0)
    salted, plain = list(range(1, 10)), list(range(50, 59))  # two full blocks each
    for seq, (tokens, salt) in enumerate([(salted, SALT), (plain, None)]):
        kv.allocate(seq, tokens, cache_salt=salt)
        kv.cache_computed_blocks(seq, tokens, len(tokens))
        kv.free(seq)
        kv.complete(kv.take_transfers().done())  # the second prompt evicts the first's blocks
    events = kv.take_tier_events()
    first = chain_hashes(salted, BS, 0, 2, root_of(SALT))
    assert {e.block_hashes[0]: e.root for e in events} == dict.fromkeys(first, root_of(SALT))
    assert root_of(SALT) != ROOT


def test_a_restored_chain_finds_its_root_whatever_the_order_and_adapter_pages_stay_silent():
    tier = KVTier(8, "DISK")
    root = root_of(SALT)
    tokens = list(range(12))
    digests = chain_hashes(tokens, BS, 0, 3, root)
    parents = [root, digests[0], digests[1]]
    blocks = [(digests[i], parents[i], tokens[i * BS : (i + 1) * BS]) for i in (2, 0, 1)]
    page, page_tokens = page_entry(7, 0xABC, 0)
    orphan = block_hash(12345, [9, 9, 9, 9])  # its parent is not in the tier
    indexed = tier.restore([*blocks, (page, ADAPTER_PAGE_PARENT, page_tokens), (orphan, 12345, [9] * 4)])
    assert set(indexed) == {*digests, page, orphan}
    roots = {e.block_hashes[0]: e.root for e in tier.take_events()}
    assert roots == {**dict.fromkeys(digests, root), orphan: None}
