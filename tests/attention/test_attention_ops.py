"""KVCache allocation, write_kv, copy_blocks, paged_attention, backend choice, bad input.

All on CPU tensors, where every backend runs (Triton through its interpreter).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import (
    BACKEND_ENV_VAR,
    AttentionMetadata,
    AttentionOptions,
    KVCache,
    check_step,
    copy_blocks,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    set_per_call_checks,
    write_kv,
)
from pagedkv.memory.kv_bytes import KVSpec

from .cases import contiguous_attention, make_case

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16")


def test_kv_cache_shapes_dtype_and_views():
    cache = KVCache(SPEC, num_blocks=5, block_size=4, dtype=torch.float32)
    assert cache.num_blocks == 5 and cache.block_size == 4 and len(cache.layers) == 3
    for layer in cache.layers:
        assert layer.key.shape == layer.value.shape == (5, 4, 2, 8)
        assert layer.key.dtype == torch.float32 and layer.key.is_contiguous()
    cache.layers[1].value[2, 3, 1, 7] = 9.0
    assert cache.data[1, 1, 2, 3, 1, 7] == 9.0  # the layers are views of one allocation
    assert cache.nbytes == 3 * 2 * 5 * 4 * 2 * 8 * 4


def test_kv_cache_dtype_defaults_to_spec():
    assert KVCache(SPEC, 2, 4).dtype == torch.float16
    with pytest.raises(ValueError, match="no attention kernel"):
        KVCache(KVSpec(1, 1, 8, dtype="int8"), 2, 4)


def test_kv_cache_from_memory_budget():
    per_block = KVCache.block_bytes(SPEC, 16, torch.bfloat16)
    assert per_block == SPEC.bytes_per_block(16)  # bf16 and the spec's fp16 are both 2 bytes
    cache = KVCache.from_memory(SPEC, 10 * per_block + per_block - 1, 16, torch.bfloat16)
    assert cache.num_blocks == 10 and cache.nbytes == 10 * per_block
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.from_memory(SPEC, per_block - 1, 16, torch.bfloat16)


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (3, 0), (2.5, 4)])
def test_kv_cache_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        KVCache(SPEC, num_blocks, block_size, torch.float32)


def test_write_kv_scatters_and_skips_negative_slots():
    cache = KVCache(SPEC, 4, 4, torch.float32)
    layer = cache.layers[2]
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv(key, value, layer, torch.tensor([13, -1, 2]))
    torch.testing.assert_close(layer.key[3, 1], key[0])
    torch.testing.assert_close(layer.value[0, 2], value[2])
    written = torch.zeros(4, 4, dtype=torch.bool)
    written[3, 1] = written[0, 2] = True
    assert (layer.key[~written] == 0).all() and (layer.value[~written] == 0).all()
    assert (cache.layers[0].key == 0).all()  # other layers untouched


def test_write_kv_rejects_bad_input():
    layer = KVCache(SPEC, 4, 4, torch.float32).layers[0]
    key = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="slot 16 is past"):
        write_kv(key, key, layer, torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="dtype"):
        write_kv(key.half(), key.half(), layer, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="KV heads"):
        write_kv(torch.randn(2, 4, 8), torch.randn(2, 4, 8), layer, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="one slot per token"):
        write_kv(key, key, layer, torch.tensor([0]))


def test_copy_blocks_copies_every_layer_from_the_old_state():
    cache = KVCache(SPEC, 4, 2, torch.float32)
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.data.clone()
    copy_blocks(cache, [(0, 1), (1, 3)])  # block 1 is both a destination and a source
    torch.testing.assert_close(cache.data[:, :, 1], before[:, :, 0])
    torch.testing.assert_close(cache.data[:, :, 3], before[:, :, 1])
    torch.testing.assert_close(cache.data[:, :, [0, 2]], before[:, :, [0, 2]])
    with pytest.raises(ValueError, match="outside the pool"):
        copy_blocks(cache, [(0, 4)])
    with pytest.raises(ValueError, match="appears twice"):
        copy_blocks(cache, [(0, 2), (1, 2)])


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_paged_attention_decode_and_prefill_steps(backend):
    """A prefill step then a decode step through the one call a model makes."""
    bs, heads, dim = 4, 4, 16
    cache = KVCache(KVSpec(1, 2, dim, "float32"), 8, bs, torch.float32)
    layer = cache.layers[0]
    cache.data.fill_(float("nan"))
    tables = torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32)
    k_all, v_all, q_all = torch.randn(11, 2, dim), torch.randn(11, 2, dim), torch.randn(11, heads, dim)
    # prefill: sequence 0 has 6 tokens, sequence 1 has 3, plus one padding token (slot -1)
    slots = [5 * bs + i for i in range(4)] + [2 * bs, 2 * bs + 1] + [7 * bs + i for i in range(3)] + [-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        context_lens=torch.tensor([6, 3], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 6, 9], dtype=torch.int32),
        max_query_len=6,
    )
    options = AttentionOptions(dim**-0.5)
    out = paged_attention(q_all[:10], k_all[:10], v_all[:10], layer, meta, options, backend)
    assert (out[9] == 0).all()  # the padding row
    torch.testing.assert_close(out[:6], contiguous_attention(q_all[:6], k_all[:6], v_all[:6], dim**-0.5))
    torch.testing.assert_close(out[6:9], contiguous_attention(q_all[6:9], k_all[6:9], v_all[6:9], dim**-0.5))
    # decode: one new token each; sequence 0 position 6, sequence 1 position 3
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([2 * bs + 2, 7 * bs + 3]),
        block_tables=tables,
        context_lens=torch.tensor([7, 4], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        max_query_len=1,
    )
    q, k, v = q_all[[0, 10]], k_all[[0, 10]], v_all[[0, 10]]
    out = paged_attention(q, k, v, layer, meta, options, backend)
    keys0, vals0 = torch.cat([k_all[:6], k[:1]]), torch.cat([v_all[:6], v[:1]])
    keys1, vals1 = torch.cat([k_all[6:9], k[1:]]), torch.cat([v_all[6:9], v[1:]])
    torch.testing.assert_close(out[0:1], contiguous_attention(q[:1], keys0, vals0, dim**-0.5))
    torch.testing.assert_close(out[1:2], contiguous_attention(q[1:], keys1, vals1, dim**-0.5))


def decode_args(case, **overrides):
    args = dict(
        q=torch.randn(len(case.keys), 4, case.layer.head_dim),
        layer=case.layer,
        block_tables=case.block_tables,
        context_lens=case.context_lens,
        scale=0.1,
    )
    args.update(overrides)
    return args


def test_bad_input_raises_clear_errors():
    case = make_case([5, 9], 4, 2, 16, device="cpu")
    ok = decode_args(case)
    paged_decode_attention(**ok)  # the baseline is valid
    bad_table = case.block_tables.clone()
    bad_table[1, 2] = case.layer.num_blocks
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\] = .* outside the pool"):
        paged_decode_attention(**decode_args(case, block_tables=bad_table))
    bad_table[1, 2] = -1
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode_attention(**decode_args(case, block_tables=bad_table))
    capacity = case.block_tables.shape[1] * 4
    with pytest.raises(ValueError, match=f"exceeds the block table's capacity of {capacity}"):
        too_long = torch.tensor([5, capacity + 1], dtype=torch.int32)
        paged_decode_attention(**decode_args(case, context_lens=too_long))
    with pytest.raises(ValueError, match="at least one token"):
        paged_decode_attention(**decode_args(case, context_lens=torch.tensor([0, 3], dtype=torch.int32)))
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(**decode_args(case, q=ok["q"].double()))
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(**decode_args(case, q=torch.randn(2, 3, 16)))
    with pytest.raises(ValueError, match="head_dim 8"):
        paged_decode_attention(**decode_args(case, q=torch.randn(2, 4, 8)))
    with pytest.raises(ValueError, match="3 query tokens but 2 sequences"):
        paged_decode_attention(**decode_args(case, q=torch.randn(3, 4, 16)))
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(**ok, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        paged_decode_attention(**ok, soft_cap=-1.0)


def test_bad_prefill_lengths_raise():
    case = make_case([5, 9], 4, 2, 16, device="cpu")
    q = torch.randn(8, 4, 16)
    cu = lambda values: torch.tensor(values, dtype=torch.int32)
    with pytest.raises(ValueError, match="6 query tokens but a context of only 5"):
        paged_prefill_attention(q, case.layer, case.block_tables, cu([0, 6, 8]), case.context_lens, 0.1)
    with pytest.raises(ValueError, match="at most at the number of query tokens 8"):
        paged_prefill_attention(q, case.layer, case.block_tables, cu([0, 2, 9]), case.context_lens, 0.1)


def test_backend_choice_and_unknown_names(monkeypatch):
    case = make_case([5, 9], 4, 2, 16, device="cpu")
    args = decode_args(case)
    expected = paged_decode_attention(**args, backend="torch")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*\['torch', 'cpu', 'triton'\]"):
        paged_decode_attention(**args, backend="flash")
    monkeypatch.setenv(BACKEND_ENV_VAR, "nope")
    with pytest.raises(ValueError, match=rf"'nope' \(from \${BACKEND_ENV_VAR}\)"):
        paged_decode_attention(**args)
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    torch.testing.assert_close(paged_decode_attention(**args), expected)
    monkeypatch.delenv(BACKEND_ENV_VAR)
    torch.testing.assert_close(paged_decode_attention(**args), expected)  # default on CPU: the cpu path


def test_a_step_is_checked_once_for_every_layer():
    """The runner's per-step check catches what the per-call checks would, with them off."""
    set_per_call_checks(False)
    cache = KVCache(SPEC, 4, 4, torch.float32)

    def step(slots, tables, lens, cu, max_len) -> AttentionMetadata:
        as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
        return AttentionMetadata(torch.tensor(slots), as_int(tables), as_int(lens), as_int(cu), max_len)

    check_step(cache.layers[0], step([0, 1, 5], [[0, 1]], [3], [0, 3], 3), 3)  # valid
    with pytest.raises(ValueError, match="slot 16 is past"):
        check_step(cache.layers[0], step([0, 1, 16], [[0, 1]], [3], [0, 3], 3), 3)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 4 points outside the pool"):
        check_step(cache.layers[0], step([0, 1, 5], [[0, 4]], [6], [0, 3], 3), 3)
    with pytest.raises(ValueError, match="max_query_len is 2 but the longest query run is 3"):
        check_step(cache.layers[0], step([0, 1, 5], [[0, 1]], [3], [0, 3], 2), 3)
