"""LoRA adapter weights written into their pages of a real KV cache and read back bit-exact."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.adapter_slabs import (
    adapter_views,
    cache_slab_elements,
    check_unified_paging,
    gather_adapter_layer,
    write_adapter,
)
from pagedkv.attention.kv_cache import KVCache
from pagedkv.memory.adapter_layout import AdapterLayout, slab_elements
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


def make_cache(dtype: torch.dtype, num_blocks: int = 12, kv_cache_dtype: str = "auto") -> KVCache:
    return KVCache(KVSpec(3, 2, 8), num_blocks, 4, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


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
    slab = cache_slab_elements(cache)
    assert slab == slab_elements(4, 2, 8) == 128
    shapes = [{t: (tuple(a.shape), tuple(b.shape)) for t, (a, b) in layer.items()} for layer in weights]
    # rank 4, a full layer: q, o 2*192; k, v 2*(192+64); gate, up, down 3*(192+384) = 3008 elements
    assert AdapterLayout.of(shapes).layer_elements(0) == 3008
    pages = AdapterLayout.of(shapes).pages(slab)
    assert pages == 24  # ceil(3008 / 128)
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


def test_a_layer_is_one_gather_whose_tensors_are_views():
    cache = make_cache(torch.float32, num_blocks=30)
    weights = make_weights(2, torch.float32, seed=3)
    shapes = [{t: (tuple(a.shape), tuple(b.shape)) for t, (a, b) in layer.items()} for layer in weights]
    pages = AdapterLayout.of(shapes).pages(cache_slab_elements(cache))
    block_ids = list(range(pages - 1, -1, -1))
    layout = write_adapter(cache, block_ids, weights)
    read = gather_adapter_layer(cache, block_ids, layout, 0)
    a, b = read["q_proj"]
    down_a, _ = read["down_proj"]
    assert a.untyped_storage().data_ptr() == down_a.untyped_storage().data_ptr()
    assert torch.equal(a, weights[0]["q_proj"][0]) and torch.equal(b, weights[0]["q_proj"][1])


def test_weights_in_another_dtype_are_stored_in_the_cache_dtype():
    cache = make_cache(torch.bfloat16, num_blocks=30)
    weights = make_weights(2, torch.float32, seed=4)
    shapes = [{t: (tuple(a.shape), tuple(b.shape)) for t, (a, b) in layer.items()} for layer in weights]
    block_ids = list(range(AdapterLayout.of(shapes).pages(cache_slab_elements(cache))))
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
    with pytest.raises(ValueError, match="needs 12 page"):
        write_adapter(cache, [0, 1], weights)
    with pytest.raises(ValueError, match="adapter has 2 layers, the KV cache 3"):
        write_adapter(cache, [0], weights[:2])
    with pytest.raises(ValueError, match="not all blocks of a 30-block cache"):
        write_adapter(cache, list(range(25, 37)), weights)
    weights[2]["o_proj"] = (torch.zeros(2, HIDDEN), torch.zeros(HIDDEN, 3))
    with pytest.raises(ValueError, match="layer 2 target 'o_proj': A .* rank 2 but B .* rank 3"):
        write_adapter(cache, list(range(12)), weights)


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
    shapes = [{t: (tuple(a.shape), tuple(b.shape)) for t, (a, b) in layer.items()} for layer in weights]
    pages = AdapterLayout.of(shapes).pages(cache_slab_elements(cache))
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
