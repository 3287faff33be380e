"""Unified paging: adapters' weights in pages of the KV block pool. More adapters than the pool
holds at once take turns and give PEFT's tokens; an adapter evicted for KV blocks or other
adapters is read again and gives the same tokens; at every step each block's refcount is its
block tables' holders plus one for an adapter's page, and every block comes back. The forward
pass reads each adapter in its pages (no slot tensors), at its latest pages after an eviction;
a model whose rows do not fit a KV chunk computes from slots filled from the pages."""

import pytest
import torch

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.engine import InvalidRequestError
from pagedkv.models.lora import LoRASlots
from pagedkv.models.lora_paged import ModuleRows, PagedLoRA
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter, peft_greedy
from tests.lora_runs import GREEDY, MAX_NEW, run_checked
from tests.server.helpers import assert_pool_whole

PROMPTS = [[5, 9, 14], [7, 3, 22, 30, 11, 8]]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A checkpoint, four rank-4 adapters (4 pages each at block size 16) and PEFT's tokens."""
    tmp = tmp_path_factory.mktemp("lora-paging")
    base = make_checkpoint(tmp, "llama")
    folders = [make_adapter(tmp / f"a{i}", base, seed=10 + i) for i in range(4)]
    loras = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    expected = {lora.lora_int_id: peft_greedy(base, lora.lora_path, PROMPTS, MAX_NEW) for lora in loras}
    expected[None] = peft_greedy(base, None, PROMPTS, MAX_NEW)
    return base, loras, expected


def test_more_adapters_than_the_pool_holds_take_turns_and_equal_peft(case):
    """16 blocks: four adapters of 4 pages cannot all be resident beside their KV blocks, though
    four slots could hold them; they take turns in the pool, idle ones evicted."""
    base, loras, expected = case
    for lora in loras:
        assert expected[lora.lora_int_id] != expected[None]
    options = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=4, num_kv_blocks=16)
    with LLM(str(base), **options) as llm:
        engine = llm.engine
        order = [*loras, None, *loras]
        requests = [(f"{n}-{k}", p, lora) for n, lora in enumerate(order) for k, p in enumerate(PROMPTS)]
        tokens = run_checked(engine, requests)
        paged = engine.scheduler.paged_adapters
        assert paged.pages.num_evictions > 0 and paged.pages.num_loads > len(loras)
        assert_pool_whole(engine)
    for n, lora in enumerate(order):
        for k in range(len(PROMPTS)):
            assert tokens[f"{n}-{k}"] == expected[None if lora is None else lora.lora_int_id][k]


def test_an_evicted_adapter_is_read_again_and_gives_the_same_tokens(case):
    base, loras, expected = case
    first = loras[0]
    options = dict(dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4, num_kv_blocks=12)
    with LLM(str(base), **options) as llm:
        engine = llm.engine
        paged = engine.scheduler.paged_adapters
        before = run_checked(engine, [("x", PROMPTS[0], first)])
        assert paged.pages.is_resident(first.lora_int_id)  # idle, kept for its next request
        run_checked(engine, [("y", PROMPTS[1], loras[1]), ("z", PROMPTS[1], loras[2])])
        assert not paged.pages.is_resident(first.lora_int_id)  # its pages went to the others
        loads = paged.pages.num_loads
        again = run_checked(engine, [("x2", PROMPTS[0], first)])
        assert paged.pages.num_loads == loads + 1 and engine.last_step is not None
        assert before["x"] == again["x2"] == expected[first.lora_int_id][0]
        assert_pool_whole(engine)


def test_cached_kv_blocks_go_before_an_idle_adapter(case):
    """An allocation takes plain free blocks, then cached-free KV blocks, and only then the
    pages of an idle adapter."""
    base, loras, _ = case
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=12)
    with LLM(str(base), **options) as llm:
        engine = llm.engine
        paged = engine.scheduler.paged_adapters
        run_checked(engine, [("a", PROMPTS[0], loras[0])])  # 4 pages; 8 tokens fill no block
        long_prompt = list(range(4, 4 + 16 * 6 + 1))  # 7 blocks: free ones, then cached-free ones
        run_checked(engine, [("base", long_prompt, None)])
        assert paged.pages.is_resident(loras[0].lora_int_id)
        assert engine.kv_manager.pool.num_cached_free_blocks == 6
        run_checked(engine, [("base2", [p + 1 for p in long_prompt] + [5] * 32, None)])  # 9 blocks: 1 more
        assert not paged.pages.is_resident(loras[0].lora_int_id)
        assert engine.last_step.lora_adapters_resident == 0
        assert_pool_whole(engine)


def test_page_loads_and_evictions_show_in_the_step_stats(case):
    base, loras, _ = case
    options = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4, num_kv_blocks=12)
    with LLM(str(base), **options) as llm:
        engine = llm.engine
        engine.add_request("a", PROMPTS[0], GREEDY, lora_request=loras[0])
        engine.step()
        step = engine.last_step
        assert (step.lora_page_loads, step.lora_adapters_resident) == (1, 1)
        assert step.lora_pages_pinned == step.lora_pages_resident == 4
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.last_step.lora_pages_pinned == 0 and engine.last_step.lora_pages_resident == 4
        evictions = []
        for rid, lora in (("b", loras[1]), ("c", loras[2])):
            engine.add_request(rid, PROMPTS[0], GREEDY, lora_request=lora)
            while engine.has_unfinished_requests():
                engine.step()
                evictions.append(engine.last_step.lora_page_evictions)
        assert sum(evictions) >= 1
        assert_pool_whole(engine)


def test_an_adapter_held_by_a_request_cannot_be_removed_and_its_pages_return_after(case):
    base, loras, _ = case
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=16)
    with LLM(str(base), **options) as llm:
        engine = llm.engine
        engine.add_request("held", PROMPTS[0], GREEDY, lora_request=loras[0])
        engine.step()
        with pytest.raises(InvalidRequestError, match="in use by a request"):
            engine.remove_lora(loras[0].lora_int_id)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.scheduler.paged_adapters.pages.is_resident(loras[0].lora_int_id)
        assert engine.remove_lora(loras[0].lora_int_id)
        assert engine.scheduler.paged_adapters.pages.resident() == []
        pool = engine.kv_manager.pool
        assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))


def test_an_adapter_waiting_for_a_slot_is_not_passed_by_a_stream_of_another(case):
    """One slot, adapter A running, then B queued, then a new A request at every step: B is
    admitted once the A requests before it finish; later A requests wait behind it."""
    base, loras, _ = case
    a, b = loras[0], loras[1]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    options = dict(dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=4, num_kv_blocks=64)
    with LLM(str(base), **options) as llm:
        engine = llm.engine
        engine.add_request("a0", PROMPTS[0], params, lora_request=a)
        engine.step()
        engine.add_request("b", PROMPTS[0], params, lora_request=b)
        admitted_at, stream = None, 0
        for step in range(12):
            stream += 1
            engine.add_request(f"a{stream}", PROMPTS[0], params, lora_request=a)
            engine.step()
            running = {s.request.request_id for s in engine.scheduler.running}
            if "b" in running:
                admitted_at = step
                assert running == {"b"}  # the A requests queued after it wait
                break
        assert admitted_at is not None and admitted_at <= 4
        while engine.has_unfinished_requests():
            engine.step()
        assert_pool_whole(engine)


def test_slots_without_unified_paging_take_no_pages(case):
    base, loras, expected = case
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=16, lora_paging="slots")
    with LLM(str(base), **options) as llm:
        assert llm.engine.scheduler.paged_adapters is None
        out = llm.generate([PROMPTS[0]], GREEDY, lora_request=loras[0], use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected[loras[0].lora_int_id][0]
        assert_pool_whole(llm.engine)


def test_a_quantized_kv_cache_refuses_unified_paging(case):
    base, _, _ = case
    with pytest.raises(ValueError, match="cannot be paged in a quantized KV cache"):
        LLM(str(base), dtype="float32", enable_lora=True, num_kv_blocks=16, kv_cache_dtype="int8")


def test_with_a_second_tier_an_adapter_load_spills_the_cached_blocks_it_takes(case):
    """An adapter's pages may take cached-free KV blocks: with a host tier they are copied out
    before the adapter's weights overwrite them, so the prefix is served from the tier later,
    and the adapter's tokens stay PEFT's."""
    base, loras, expected = case
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=8)
    with LLM(str(base), kv_offload="host", kv_offload_memory="1MiB", **options) as llm:
        engine = llm.engine
        long_prompt = list(range(4, 4 + 16 * 5 + 1))  # 5 full blocks, cached once computed
        run_checked(engine, [("base", long_prompt, None)])
        assert engine.kv_manager.pool.num_cached_free_blocks == 5
        tokens = run_checked(engine, [("a", PROMPTS[1], loras[0])])  # 4 pages: some of the cached blocks
        assert tokens["a"] == expected[loras[0].lora_int_id][1]
        assert engine.kv_manager.pool.num_cached_free_blocks < 5
        run_checked(engine, [("again", long_prompt, None)])
        assert engine.last_step is not None and engine.stats().tier.hit_tokens > 0
        assert_pool_whole(engine)


def test_the_forward_reads_adapters_in_their_pages_and_the_model_holds_no_slot_tensors(case):
    """Unified paging: an adapter's weights exist once, in its pages; the model keeps per
    projection only a table of offsets into the KV cache (and a scaling per slot)."""
    base, loras, expected = case
    options = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=4, num_kv_blocks=16)
    with LLM(str(base), **options) as llm:
        runner = llm.engine.executor.runner
        lora = runner.model.lora
        assert isinstance(lora, PagedLoRA) and all(isinstance(m, ModuleRows) for m in lora.modules.values())
        cache = runner.kv_cache.data
        for module in lora.modules.values():
            weights = module.weights
            assert weights.base.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
            assert weights.offsets.dtype == torch.int64
        floats = [t for t in vars(lora).values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
        assert [t.numel() for t in floats] == [cache.numel(), 4]  # the cache itself; the scalings
        out = llm.generate([PROMPTS[0]] * 2, GREEDY, lora_request=[loras[0], None], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [expected[loras[0].lora_int_id][0], expected[None][0]]


def test_an_adapter_written_into_other_pages_is_read_there(case):
    """An idle adapter keeps its slot while KV blocks take its pages; its next request writes it
    into other pages, and its slot's offsets are rebuilt from that write, never left stale."""
    base, loras, expected = case
    first = loras[0]
    options = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4, num_kv_blocks=12)
    with LLM(str(base), **options) as llm:
        engine = llm.engine
        paged, slots = engine.scheduler.paged_adapters, engine.scheduler.adapters
        run_checked(engine, [("a", PROMPTS[0], first)])
        old = set(paged.pages.block_ids(first.lora_int_id))
        run_checked(engine, [("base", list(range(4, 4 + 16 * 8 + 1)), None)])  # 9 blocks: one of its pages
        assert not paged.pages.is_resident(first.lora_int_id)
        placed = slots.loads
        again = run_checked(engine, [("a2", PROMPTS[0], first)])
        assert slots.loads == placed and slots.slot_of(first.lora_int_id) is not None  # no slot load
        assert set(paged.pages.block_ids(first.lora_int_id)) != old
        assert again["a2"] == expected[first.lora_int_id][0]
        assert_pool_whole(engine)


def test_rows_wider_than_a_kv_chunk_are_computed_from_slots_filled_from_the_pages(tmp_path, caplog):
    """MLP rows of 640 elements do not fit a chunk of 16 tokens * 2 heads * 16 = 512: the pages
    still hold the adapter, and slots filled from them compute it, with PEFT's tokens."""
    base = make_checkpoint(tmp_path, "llama", intermediate_size=640)
    lora = LoRARequest("wide", 1, str(make_adapter(tmp_path / "wide", base, seed=3)))
    expected = peft_greedy(base, lora.lora_path, PROMPTS, MAX_NEW)
    options = dict(dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=24)
    with caplog.at_level("WARNING"), LLM(str(base), **options) as llm:
        assert isinstance(llm.engine.executor.runner.model.lora, LoRASlots)
        out = llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == expected
        assert llm.engine.scheduler.paged_adapters.pages.is_resident(1)
    assert "rows of 640 elements do not fit a KV chunk of 512 elements" in caplog.text


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pages_and_slots_give_the_same_tokens(case, dtype):
    """Three adapters and the base model mixed: in bfloat16 the paged and the slot kernels sum
    in one order (the same bits); float16 runs the torch form, which gathers the step's adapters'
    rows out of the pages (the engine's path off the C kernel, as on CUDA)."""
    base, loras, _ = case
    prompts = [PROMPTS[k % 2] for k in range(8)]
    requests = [loras[k % 3] if k % 4 else None for k in range(8)]
    tokens = {}
    for paging in ("unified", "slots"):
        options = dict(dtype=dtype, enable_lora=True, max_loras=3, max_lora_rank=4, num_kv_blocks=64)
        with LLM(str(base), lora_paging=paging, **options) as llm:
            out = llm.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False)
            tokens[paging] = [o.outputs[0].token_ids for o in out]
    assert tokens["unified"] == tokens["slots"]
    assert len({tuple(t) for t in tokens["unified"]}) > 2  # the adapters change the tokens
