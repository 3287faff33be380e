"""Unified paging against fixed LoRA slots at one memory budget, computed by hand."""

from __future__ import annotations

import pytest

from pagedkv.bench.lora_capacity import Comparison, LoraBudget
from pagedkv.memory.adapter_layout import AdapterLayout, chunk_elements

# SmolLM2-135M's shapes in bfloat16: 30 layers, hidden 576, 9 query heads and 3 KV heads of 64,
# intermediate 1536; blocks of 16 tokens.
LAYERS, HIDDEN, KV_DIM, INTER, BLOCK = 30, 576, 192, 1536, 16
DIMS = {
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV_DIM),
    "v_proj": (HIDDEN, KV_DIM),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTER),
    "up_proj": (HIDDEN, INTER),
    "down_proj": (INTER, HIDDEN),
}


def layout(rank: int) -> AdapterLayout:
    layer = {t: ((rank, d_in), (d_out, rank)) for t, (d_in, d_out) in DIMS.items()}
    return AdapterLayout.of([layer] * LAYERS, chunk_elements(BLOCK, 3, 64))


def test_one_gib_with_rank_16_adapters_against_8_slots_of_rank_64():
    # One layer of a rank-16 adapter: q, o 2*(16*576 + 576*16); k, v 2*(16*576 + 192*16);
    # gate, up, down 3*(16*576 + 1536*16) = 36864 + 24576 + 101376 = 162816 elements. A chunk
    # (one block's keys or values in a layer) is 16 * 3 * 64 = 3072 elements: rows of 1536 go
    # two to a chunk, of 576 five (192 left, which rows of 192 fill), so no chunk has a gap:
    # ceil(162816 / 3072) = 53 chunks, two to a block, 27 pages.
    assert layout(16).layer_elements(0) == 162816
    assert chunk_elements(BLOCK, 3, 64) == 3072
    pages = layout(16).pages
    assert pages == 27
    block_bytes = LAYERS * 2 * 3072 * 2  # 368640
    slot_bytes = LAYERS * layout(64).layer_elements(0) * 2  # rank 64: 4 * 162816 elements a layer
    assert slot_bytes == 39_075_840
    budget = LoraBudget(1 << 30, block_bytes, BLOCK, pages, slot_bytes, max_loras=8)
    # 1073741824 // 368640 = 2912 blocks; beside 8 slots (312606720 bytes): 761135104 // 368640 = 2064.
    assert (budget.pool_blocks, budget.slot_blocks) == (2912, 2064)
    # Requests of 2048 tokens (128 blocks) while 2 adapters are in use:
    # unified (2912 - 2 * 27) // 128 = 22, slots 2064 // 128 = 16.
    assert budget.concurrent_requests(2048, 2) == Comparison(unified=22, slots=16)
    # Adapters beside 4 such requests (512 blocks): unified (2912 - 512) // 27 = 88, slots 8.
    assert budget.resident_adapters(2048, 4) == Comparison(unified=88, slots=8)
    # 17 requests overflow the slots' KV share (2176 > 2064 blocks) but not the unified pool.
    assert budget.resident_adapters(2048, 17) == Comparison(unified=(2912 - 2176) // 27, slots=0)


def test_slots_that_overflow_the_budget_are_refused():
    with pytest.raises(ValueError, match="8 adapter slots of 200 bytes exceed the budget of 1000"):
        LoraBudget(1000, 100, 16, 1, 200, 8)
    with pytest.raises(ValueError, match="LoraBudget.adapter_pages must be a positive integer"):
        LoraBudget(1000, 100, 16, 0, 10, 8)
