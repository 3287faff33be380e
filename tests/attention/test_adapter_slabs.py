"""LoRA adapter weights written into their pages of a real KV cache, read back bit-exact, and
found in place by their rows' offsets."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.adapter_slabs import (
    adapter_views,
    cache_chunk_elements,
    check_unified_paging,
    row_offsets,
    write_adapter,
)
from pagedkv.attention.kv_cache import KVCache
from pagedkv.memory.adapter_layout import AdapterLayout, chunk_elements
from pagedkv.memory.kv_bytes import KVSpec

# A small model's shapes: hidden 48, 2 KV heads of 8 (kv dim 16), intermediate 96.
HIDDEN, KV_DIM, INTER = 48, 16, 96
TARGET_DIMS = {
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV_DIM),
    "v_proj": (HIDDEN, KV_DIM),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTER),
    "up_proj": (HIDDEN, INTER),
    "down_proj": (INTER, HIDDEN),
}


def make_cache(
    dtype: torch.dtype, num_blocks: int = 12, kv_cache_dtype: str = "auto", block_size: int = 4
) -> KVCache:
    """Chunks of ``block_size * 16`` elements: 64 by default, narrower than the MLP's rows."""
    return KVCache(KVSpec(3, 2, 8), num_blocks, block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


def layout_of(weights: list[dict], cache: KVCache) -> AdapterLayout:
    shapes = [{t: (tuple(a.shape), tuple(b.shape)) for t, (a, b) in layer.items()} for layer in weights]
    return AdapterLayout.of(shapes, cache_chunk_elements(cache))


def row_spans(layout: AdapterLayout, layer: int) -> list[tuple[int, int]]:
    """Every row's ``(start, end)`` positions in the layer, in order."""
    spans = []
    for slot in layout.layers[layer]:
        spans += [(p, p + slot.a_shape[1]) for p in slot.a_rows] + [
            (p, p + slot.b_shape[0]) for p in slot.b_rows
        ]
    return sorted(spans)


def test_rows_are_packed_widest_first_and_never_straddle_a_chunk():
    """Chunks of 10: B [6, 2] transposed is two rows of 6, first (the widest): at 0, and at 10
    (6 + 6 would straddle); A [2, 4]'s rows fill the ends they leave, at 6 and 16. 20 positions
    are 2 chunks, one page."""
    layout = AdapterLayout.of([{"o_proj": ((2, 4), (6, 2))}], 10)
    (slot,) = layout.layers[0]
    assert slot.b_rows == (0, 10) and slot.a_rows == (6, 16)
    assert layout.layer_elements(0) == 20 and layout.pages == 1 and layout.rows_fit
    # Rows of 12 cannot fit chunks of 10: they follow the packed chunks end to end, and the
    # forward pass cannot read them in place.
    wide = AdapterLayout.of([{"down_proj": ((3, 12), (4, 3))}], 10)
    assert wide.layers[0][0].b_rows == (0, 4, 10) and wide.layers[0][0].a_rows == (20, 32, 44)
    assert not wide.rows_fit


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("rank", [1, 4, 7])
def test_no_row_that_fits_straddles_a_chunk_and_none_overlap(block_size, rank):
    chunk = chunk_elements(block_size, 2, 8)
    layout = layout_of(
        make_weights(rank, torch.float32, seed=0), make_cache(torch.float32, 1, block_size=block_size)
    )
    for layer in range(layout.num_layers):
        spans = row_spans(layout, layer)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        assert all(s // chunk == (e - 1) // chunk for s, e in spans if e - s <= chunk)
        assert spans[-1][1] == layout.layer_elements(layer)
    chunks = max(-(-layout.layer_elements(layer) // chunk) for layer in range(layout.num_layers))
    assert layout.pages == -(-chunks // 2)  # two chunks (keys, values) to a page


def make_weights(rank: int, dtype: torch.dtype, seed: int, layers: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for layer in range(layers):
        # The middle layer adapts attention only, as PEFT's target_modules can.
        names = list(TARGET_DIMS) if layer != 1 else ["q_proj", "v_proj"]
        weights.append(
            {
                t: (
                    torch.randn(rank, TARGET_DIMS[t][0], generator=gen).to(dtype),
                    torch.randn(TARGET_DIMS[t][1], rank, generator=gen).to(dtype),
                )
                for t in names
            }
        )
    return weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_and_touches_only_the_pages(dtype):
    cache = make_cache(dtype, num_blocks=30)
    cache.data.normal_(generator=torch.Generator().manual_seed(1))  # stale KV everywhere
    before = cache.data.clone()
    weights = make_weights(4, dtype, seed=2)
    layout = layout_of(weights, cache)
    pages = layout.pages
    assert not layout.rows_fit  # the MLP's rows of 96 run over chunks of 64: still read back whole
    block_ids = torch.randperm(30, generator=torch.Generator().manual_seed(9))[:pages].tolist()
    layout = write_adapter(cache, block_ids, weights)

    views = adapter_views(cache, block_ids, layout)
    for layer, (written, read) in enumerate(zip(weights, views, strict=True)):
        assert list(read) == list(written), f"layer {layer}"
        for target, (a, b) in written.items():
            ra, rb = read[target]
            assert ra.dtype == dtype and torch.equal(ra, a) and torch.equal(rb, b)
    untouched = torch.ones(cache.num_blocks, dtype=torch.bool)
    untouched[block_ids] = False
    assert torch.equal(cache.data[:, :, untouched], before[:, :, untouched])
    # The middle layer's short weights leave the rest of its pages zeroed, not stale.
    tail = cache.data[1, :, block_ids[-1]]
    assert torch.count_nonzero(tail) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_s_offset_finds_it_in_the_cache(dtype):
    """With chunks of 128 every row fits one: row ``j`` of ``A`` (and of ``B`` transposed) is
    the run of elements at its offset in the flat cache."""
    cache = make_cache(dtype, num_blocks=30, block_size=8)
    weights = make_weights(3, dtype, seed=3)
    layout = layout_of(weights, cache)
    assert layout.rows_fit
    block_ids = torch.randperm(30, generator=torch.Generator().manual_seed(4))[: layout.pages].tolist()
    assert write_adapter(cache, block_ids, weights) == layout
    flat = cache.data.view(-1)
    for layer, targets in enumerate(row_offsets(cache, block_ids, layout)):
        assert list(targets) == list(weights[layer])
        for target, (a_rows, b_rows) in targets.items():
            a, b = weights[layer][target]
            for j in range(a.shape[0]):
                assert torch.equal(flat[int(a_rows[j]) : int(a_rows[j]) + a.shape[1]], a[j])
                assert torch.equal(flat[int(b_rows[j]) : int(b_rows[j]) + b.shape[0]], b[:, j])


def test_rows_wider_than_a_chunk_have_no_offsets():
    cache = make_cache(torch.float32, num_blocks=30)
    weights = make_weights(2, torch.float32, seed=3)
    layout = write_adapter(cache, list(range(layout_of(weights, cache).pages)), weights)
    with pytest.raises(ValueError, match="rows wider than a KV chunk of 64 elements"):
        row_offsets(cache, list(range(layout.pages)), layout)


def test_weights_in_another_dtype_are_stored_in_the_cache_dtype():
    cache = make_cache(torch.bfloat16, num_blocks=30)
    weights = make_weights(2, torch.float32, seed=4)
    block_ids = list(range(layout_of(weights, cache).pages))
    layout = write_adapter(cache, block_ids, weights)
    a, _ = adapter_views(cache, block_ids, layout)[2]["gate_proj"]
    assert a.dtype == torch.bfloat16
    assert torch.equal(a, weights[2]["gate_proj"][0].to(torch.bfloat16))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_a_quantized_kv_cache_is_refused(kv_cache_dtype):
    cache = make_cache(torch.float32, kv_cache_dtype=kv_cache_dtype)
    with pytest.raises(ValueError, match=f"quantized KV cache.*{kv_cache_dtype}"):
        check_unified_paging(cache)
    with pytest.raises(ValueError, match="quantized KV cache"):
        write_adapter(cache, [0], [{}, {}, {}])


def test_bad_pages_and_shapes_are_refused_by_name():
    cache = make_cache(torch.float32, num_blocks=30)
    weights = make_weights(2, torch.float32, seed=5)
    needed = layout_of(weights, cache).pages
    with pytest.raises(ValueError, match=f"needs {needed} page"):
        write_adapter(cache, [0, 1], weights)
    with pytest.raises(ValueError, match="adapter has 2 layers, the KV cache 3"):
        write_adapter(cache, [0], weights[:2])
    with pytest.raises(ValueError, match="not all blocks of a 30-block cache"):
        write_adapter(cache, list(range(30 - needed + 1, 31)), weights)
    weights[2]["o_proj"] = (torch.zeros(2, HIDDEN), torch.zeros(HIDDEN, 3))
    with pytest.raises(ValueError, match="layer 2 target 'o_proj': A .* rank 2 but B .* rank 3"):
        write_adapter(cache, list(range(needed)), weights)


def test_a_peft_adapter_read_back_from_its_pages_computes_peft_s_outputs():
    """A PEFT LoRA on a tiny Llama, every target module, paged into a KV cache of the model's
    own shape: each module's output from the read-back A and B equals PEFT's, bit for bit."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGET_DIMS), init_lora_weights=False)
    model = peft.get_peft_model(LlamaForCausalLM(config), lora)
    modules = []
    for layer in model.base_model.model.model.layers:
        attention = {t: getattr(layer.self_attn, t) for t in ("q_proj", "k_proj", "v_proj", "o_proj")}
        modules.append(attention | {t: getattr(layer.mlp, t) for t in ("gate_proj", "up_proj", "down_proj")})
    weights = [
        {
            t: (m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach())
            for t, m in layer.items()
        }
        for layer in modules
    ]
    cache = KVCache(KVSpec(2, 2, 8), 16, 4, dtype=torch.float32)  # the model's 2 KV heads of 8
    pages = layout_of(weights, cache).pages
    block_ids = list(range(15, 15 - pages, -1))
    layout = write_adapter(cache, block_ids, weights)
    linear = torch.nn.functional.linear
    with torch.no_grad():
        for layer, read in zip(modules, adapter_views(cache, block_ids, layout), strict=True):
            for target, module in layer.items():
                a, b = read[target]
                x = torch.randn(3, a.shape[1])
                ours = module.base_layer(x) + linear(linear(x, a), b) * module.scaling["default"]
                assert torch.equal(module(x), ours), target
