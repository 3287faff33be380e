"""The host tier's byte movers: blocks leave the pool and come back with exactly the same bits,
in every element type (quantized blocks with their scales), layer by layer, and only where asked;
and the moves in a step's order keep what the memory layer promised."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import KVCache, write_kv
from pagedkv.memory import KVTier, TieredKVCacheManager, TransferReport
from pagedkv.memory.kv_bytes import KVSpec
from pagedkv.memory.tier.host import HostKVTier, KVLayout, gather_blocks, load_blocks, store_blocks
from pagedkv.memory.tier.movers import HostTierMover
from tests.attention.cases import DEVICE

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")
#: (model dtype, kv_cache_dtype): every element type a block is stored in
KINDS = [
    (torch.float32, "auto"),
    (torch.bfloat16, "auto"),
    (torch.float16, "auto"),
    (torch.float32, "fp8"),
    (torch.bfloat16, "int8"),
]


def random_cache(dtype, kv_cache_dtype, num_blocks=8, block_size=4, seed=0) -> KVCache:
    """A pool whose every byte is random: NaN and infinity patterns included, so a copy that
    went through a float conversion anywhere would change some of them."""
    cache = KVCache(SPEC, num_blocks, block_size, dtype, DEVICE, kv_cache_dtype)
    gen = torch.Generator().manual_seed(seed)
    raw = cache.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    if cache.scales is not None:
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=gen) * 3)
    return cache


def block_bytes(cache: KVCache, block: int) -> tuple[bytes, bytes]:
    data = cache.data.view(torch.uint8)[:, :, block].cpu().numpy().tobytes()
    scales = b"" if cache.scales is None else cache.scales[:, :, block].cpu().numpy().tobytes()
    return data, scales


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), KINDS)
def test_blocks_round_trip_bit_for_bit_into_other_blocks(dtype, kv_cache_dtype):
    cache = random_cache(dtype, kv_cache_dtype)
    tier = HostKVTier.for_cache(cache, capacity=9)
    before = {block: block_bytes(cache, block) for block in range(cache.num_blocks)}
    store_blocks(cache, tier, [(3, 7), (0, 1), (5, 2)])
    load_blocks(tier, cache, [(7, 6), (1, 4), (2, 0)])  # block 0 is overwritten by block 5's slot
    after = {block: block_bytes(cache, block) for block in range(cache.num_blocks)}
    assert after[6] == before[3] and after[4] == before[0] and after[0] == before[5]
    for block in (1, 2, 3, 5, 7):  # nothing else changed
        assert after[block] == before[block]
    assert tier.layout.block_bytes == KVCache.block_bytes(SPEC, 4, dtype, kv_cache_dtype)
    assert tier.nbytes == 9 * tier.layout.block_bytes


def test_a_slot_is_one_contiguous_run_of_its_blocks_bytes_layer_by_layer():
    cache = random_cache(torch.float32, "auto")
    data, scales = gather_blocks(cache, [2])
    assert scales is None and data.shape == (1, *KVLayout.of(cache, "m").data_shape)
    for layer in range(SPEC.num_layers):
        for kv in range(2):
            assert torch.equal(data[0, layer, kv], cache.data[layer, kv, 2].cpu().view(torch.uint8))


def test_quantized_blocks_move_with_their_scales_and_dequantize_the_same():
    cache = KVCache(SPEC, 4, 4, torch.float32, DEVICE, "fp8")
    keys = torch.randn(6, SPEC.num_kv_heads, SPEC.head_dim, device=DEVICE) * 5
    for layer in cache.layers:
        write_kv(keys, -keys, layer, torch.arange(6, device=DEVICE))  # blocks 0 and 1
    expected = cache.layers[1].key[:2].float() * cache.layers[1].key_scale[:2].unsqueeze(-1)
    tier = HostKVTier.for_cache(cache, 2)
    store_blocks(cache, tier, [(0, 0), (1, 1)])
    load_blocks(tier, cache, [(0, 2), (1, 3)])
    got = cache.layers[1].key[2:].float() * cache.layers[1].key_scale[2:].unsqueeze(-1)
    assert torch.equal(got, expected)


def test_bad_moves_are_refused_before_any_byte_moves():
    cache = random_cache(torch.float32, "auto")
    tier = HostKVTier.for_cache(cache, 2)
    before = tier.data.clone()
    with pytest.raises(ValueError, match="slot 2 is outside the tier of 2"):
        store_blocks(cache, tier, [(0, 0), (1, 2)])
    with pytest.raises(ValueError, match="block 8 is outside the pool of 8"):
        store_blocks(cache, tier, [(8, 0)])
    with pytest.raises(ValueError, match="appears twice"):
        load_blocks(tier, cache, [(0, 1), (1, 1)])
    assert torch.equal(tier.data, before)
    quantized = random_cache(torch.float32, "int8")
    with pytest.raises(ValueError, match="scales"):
        load_blocks(tier, quantized, [(0, 1)])
    with pytest.raises(ValueError, match="layout"):
        tier.check_fits(random_cache(torch.bfloat16, "auto"))


def test_spill_then_load_in_the_executors_order_gives_back_the_computed_keys():
    """The memory layer's plan and these movers together: a prefix computed into the pool,
    evicted by other requests (spilled in the step that reuses its blocks, before that step
    writes them), comes back by a load with the keys it was computed with."""
    block_size, prompt = 4, list(range(9))
    kv = TieredKVCacheManager(3, block_size, KVTier(4), 1000, watermark=0.0)
    cache = KVCache(SPEC, 3, block_size, torch.float32, DEVICE)
    mover = HostTierMover(HostKVTier.for_cache(cache, 4))

    def step(seq, tokens):
        """Admit, move, then compute every token not cached (keys: a function of the token
        and its position); returns the block table."""
        cached = kv.allocate(seq, tokens)
        transfers = kv.take_transfers()
        mover.store(cache, transfers)
        loaded = mover.load(cache, transfers)
        kv.complete(TransferReport(stored=mover.take_stored(), loaded=loaded))
        table = kv.block_ids(seq)
        positions = range(cached, len(tokens))
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])
        shape = (SPEC.num_kv_heads, SPEC.head_dim)
        keys = torch.stack([torch.full(shape, tokens[p] * 100.0 + p) for p in positions])
        for layer in cache.layers:
            write_kv(keys.to(DEVICE), keys.to(DEVICE), layer, slots.to(DEVICE))
        kv.cache_computed_blocks(seq, tokens, len(tokens))
        return table, transfers

    table, _ = step("a", prompt)
    computed = cache.data[:, :, table[:2]].clone()
    kv.free("a")
    _, transfers = step("b", [50 + t for t in range(9)])  # reuses every block
    assert len(transfers.spills) == 2
    kv.free("b")
    table, transfers = step("c", prompt)
    assert len(transfers.loads) == 2 and kv.tier_hit_tokens == 8
    assert torch.equal(cache.data[:, :, table[:2]], computed)
