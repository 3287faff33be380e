"""Unified LoRA paging under hybrid (KV-group) paging: a Gemma 2 whose sliding and full layers
are paged by group keeps hybrid paging on with adapters in the pool. Each adapter takes its
pages once per KV group, each layer's rows in its group's pages; two adapters and base rows
mixed give PEFT's float32 greedy tokens past the window, also in a pool small enough that
adapters are evicted and read again; at every step each block's refcount is its tables' holders
plus one for an adapter's page (and one for the null block), and every block comes back."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.models.lora_paged import PagedLoRA
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.lora_adapters import make_adapter, peft_greedy

MAX_NEW = 12
WINDOW = 8
#: five layers, alternating sliding and full: 3 sliding and 2 full are 3 groups of at most 2
#: layers (full, sliding, sliding), the last one layer deep
GEMMA2 = {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "num_hidden_layers": 5}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Past the window, so the sliding groups hand blocks back while adapters are resident."""
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(4, TEST_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (5, 19, 30)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-hybrid")
    base = make_checkpoint(tmp, "gemma2", **GEMMA2)
    loras = [
        LoRARequest(f"a{i}", i + 1, str(make_adapter(tmp / f"a{i}", base, seed=30 + i))) for i in range(3)
    ]
    expected = {lora.lora_int_id: peft_greedy(base, lora.lora_path, _prompts(), MAX_NEW) for lora in loras}
    expected[None] = peft_greedy(base, None, _prompts(), MAX_NEW)
    return base, loras, expected


def _llm(base, **options) -> LLM:
    settings = dict(
        dtype="float32", enable_lora=True, max_lora_rank=4, block_size=8, max_num_batched_tokens=16
    )
    return LLM(str(base), **(settings | options))


def _check_holders(engine) -> None:
    """Each block's refcount is the tables holding it, plus one if it is an adapter's page, plus
    one for the null block; an adapter's pins are its running sequences that hold a table."""
    kv, paged = engine.kv_manager, engine.scheduler.paged_adapters
    holders = Counter(b for t in kv.snapshot().tables.values() for b in t.block_ids)
    resident = paged.pages.resident()
    pages = Counter(b for r in resident for b in r.block_ids)
    assert all(n == 1 for n in pages.values()) and not set(pages) & set(holders)
    assert kv.null_block not in pages and kv.null_block not in holders
    assert [kv.pool.refcount(b) for b in range(kv.pool.num_blocks)] == [
        holders[b] + pages[b] + (b == kv.null_block) for b in range(kv.pool.num_blocks)
    ]
    running = Counter(s.request.lora_int_id for s in engine.scheduler.running if s.seq_id in kv)
    assert {r.adapter_id: r.pins for r in resident if r.pins} == {k: n for k, n in running.items() if k}


def _run(engine, requests) -> dict[str, list[int]]:
    for rid, prompt, lora in requests:
        engine.add_request(rid, prompt, GREEDY, lora_request=lora)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        _check_holders(engine)
    return tokens


def _assert_pool_whole(engine) -> None:
    """Idle: only idle adapters' pages and the null block are held, each once."""
    kv, paged = engine.kv_manager, engine.scheduler.paged_adapters
    assert kv.num_seqs == 0 and not paged.pinned
    pages = {b for r in paged.pages.resident() for b in r.block_ids}
    held = pages | {kv.null_block}
    assert all(kv.pool.refcount(b) == (b in held) for b in range(kv.pool.num_blocks))
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1


def _pages_per_group(engine, lora: LoRARequest) -> int:
    """The pages ``lora``'s layers take in one block id per layer (its layout's, ungrouped)."""
    return engine.loras.paged_file(lora.lora_int_id, engine.settings.cache.block_size).pages


@pytest.mark.parametrize("block_size", [8, 2])
def test_hybrid_paging_stays_on_and_mixed_adapters_equal_peft(case, block_size):
    """Blocks of 8 tokens: the forward pass reads the rows in their pages; of 2 (KV chunks of 64
    elements, narrower than the MLP's rows of 128): from slots filled from the pages."""
    base, loras, expected = case
    for lora in loras:
        assert expected[lora.lora_int_id] != expected[None]
    with _llm(base, max_loras=2, num_kv_blocks=2048 // block_size, block_size=block_size) as llm:
        engine = llm.engine
        described = repr(llm)
        assert "hybrid kv 3 KV groups of 2 layers" in described
        in_place = isinstance(engine.executor.runner.model.lora, PagedLoRA)
        assert in_place == (block_size == 8)
        prompts = _prompts()
        order = [loras[0], loras[1], None]
        requests = [(f"{n}-{k}", p, lora) for n, lora in enumerate(order) for k, p in enumerate(prompts)]
        tokens = _run(engine, requests)
        for n, lora in enumerate(order):
            for k in range(len(prompts)):
                assert tokens[f"{n}-{k}"] == expected[None if lora is None else lora.lora_int_id][k]
        # each adapter holds its layout's pages once per KV group, no page twice
        resident = {r.adapter_id: r.block_ids for r in engine.scheduler.paged_adapters.pages.resident()}
        assert set(resident) == {1, 2}
        for lora in loras[:2]:
            pages = resident[lora.lora_int_id]
            assert len(pages) == len(set(pages)) == 3 * _pages_per_group(engine, lora) > 3
        snapshot = engine.kv_snapshot()  # the block map names each page's adapter
        named = Counter(b.adapter for b in snapshot.blocks if b.adapter is not None)
        assert named == {lora.lora_name: len(resident[lora.lora_int_id]) for lora in loras[:2]}
        _assert_pool_whole(engine)


def test_a_small_pool_evicts_adapters_and_keeps_peft_s_tokens(case):
    """A pool that holds one adapter's pages (three groups' worth) beside the KV blocks of a few
    sequences: the adapters take turns, idle ones evicted and written again into other pages."""
    base, loras, expected = case
    prompts = _prompts()
    with _llm(base, max_loras=1, num_kv_blocks=48, watermark=0.0) as llm:
        engine = llm.engine
        paged = engine.scheduler.paged_adapters
        order = [loras[0], loras[1], None, loras[2], loras[0]]
        requests = [(f"{n}-{k}", p, lora) for n, lora in enumerate(order) for k, p in enumerate(prompts)]
        tokens = _run(engine, requests)
        assert paged.pages.num_evictions > 0 and paged.pages.num_loads > len(loras)
        for n, lora in enumerate(order):
            for k in range(len(prompts)):
                assert tokens[f"{n}-{k}"] == expected[None if lora is None else lora.lora_int_id][k]
        _assert_pool_whole(engine)


def test_the_control_plane_counts_an_adapter_s_pages_per_group(case, caplog):
    """The pages registered at ``add_lora`` are the layout's pages times the KV groups; without
    hybrid paging, the layout's pages once. The start-up log says hybrid paging is on."""
    base, loras, _ = case
    counts = {}
    caplog.set_level(logging.INFO, logger="pagedkv.engine.worker.executor.hybrid")
    for hybrid in (True, False):
        with _llm(base, num_kv_blocks=256, disable_hybrid_kv_cache_manager=not hybrid) as llm:
            engine = llm.engine
            engine.add_lora(loras[0])
            counts[hybrid] = engine.scheduler.paged_adapters.pages_of(loras[0].lora_int_id)
            assert ("off (disable_hybrid_kv_cache_manager)" in repr(llm)) != hybrid
            assert counts[hybrid] == _pages_per_group(engine, loras[0]) * (3 if hybrid else 1)
    assert counts[True] == 3 * counts[False]
    assert "hybrid KV paging: 3 KV groups of 2 layers" in caplog.text
    assert "hybrid KV paging off for Gemma2ForCausalLM: disable_hybrid_kv_cache_manager" in caplog.text
    assert "LoRA" not in caplog.text
