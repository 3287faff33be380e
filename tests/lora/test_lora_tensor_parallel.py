"""LoRA under tensor parallelism: two ranks, each holding its shard of every adapter (``A``
whole and its rows of ``B`` on q/k/v and gate/up; its columns of ``A`` and ``B`` whole on o and
down), give PEFT's float32 greedy tokens -- and one rank's -- with two adapters and the base
model mixed in one ``generate`` call; with unified paging each rank writes its shard into its
own KV chunks of the same block ids, and a pool too small for every adapter evicts and reloads
them on every rank alike.

The adapters are made by PEFT itself with seeded non-zero ``A`` and ``B``; the tests first check
that they change the tokens (else equality would prove nothing)."""

import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.attention import resolve_backend
from pagedkv.config.lora import LoRAConfig
from pagedkv.engine.lora_registry import LoRARegistry
from pagedkv.memory.adapter_layout import AdapterLayout, chunk_elements
from pagedkv.models import ModelConfig
from pagedkv.models.lora import LoRASlots
from pagedkv.models.lora_checkpoint import read_adapter
from pagedkv.models.lora_paged import PagedLoRA
from pagedkv.models.parallel import TensorParallel
from pagedkv.models.shard_config import shard_config
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.lora_adapters import make_adapter, peft_greedy
from tests.lora_runs import MAX_NEW as RUN_MAX_NEW
from tests.lora_runs import run_checked
from tests.server.helpers import assert_pool_whole

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
OPTIONS = {"dtype": "float32", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


def _case(tmp_path, **overrides):
    """A checkpoint, two adapters (one of every target, one of q/v/down at rank 8), three
    prompts and PEFT's tokens of each adapter and of the base model."""
    base = make_checkpoint(tmp_path, "llama", **overrides)
    adapters = {
        "all": make_adapter(tmp_path / "all", base, seed=1),
        "qv-down": make_adapter(
            tmp_path / "qvd", base, seed=2, rank=8, targets=("q_proj", "v_proj", "down_proj")
        ),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (3, 11, 26)]
    expected = {name: peft_greedy(base, folder, prompts, MAX_NEW) for name, folder in adapters.items()}
    expected[None] = peft_greedy(base, None, prompts, MAX_NEW)
    for name in adapters:
        assert expected[name] != expected[None], f"adapter {name} does not change the tokens"
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    return base, requests, prompts, expected


@pytest.mark.parametrize(
    ("overrides", "paging", "block_size"),
    [({}, "unified", 16), ({"num_key_value_heads": 1}, "unified", 16), ({}, "unified", 2), ({}, "slots", 16)],
    # one KV head: both ranks hold a copy of it and cut the same rows of k/v's B; a block id is
    # then one head's chunks on each rank. Blocks of 2 tokens: chunks narrower than the rows,
    # which are computed from slots filled from the pages
    ids=["gqa-unified", "kv-head-replicated-unified", "rows-wider-than-chunks", "gqa-slots"],
)
def test_two_ranks_with_mixed_adapters_equal_peft_and_one_rank(tmp_path, overrides, paging, block_size):
    base, requests, prompts, expected = _case(tmp_path, **overrides)
    order = ["all", None, "qv-down", "all"]
    options = OPTIONS | {
        "lora_paging": paging,
        "block_size": block_size,
        "num_kv_blocks": 128 * 16 // block_size,
        "max_num_batched_tokens": 24,  # prompts in chunks, beside other adapters' decodes
    }
    got, pages = {}, {}
    for size in (1, 2):
        with LLM(str(base), tensor_parallel_size=size, **options) as llm:
            outs = llm.generate(
                [p for _ in order for p in prompts],
                GREEDY,
                lora_request=[None if n is None else requests[n] for n in order for _ in prompts],
                use_tqdm=False,
            )
            paged = llm.engine.scheduler.paged_adapters
            assert (paged is not None) == (paging == "unified")
            # rank 0 (in this process) reads its shard where it is, in its pages, if rows fit
            in_place = paged is not None and block_size == 16
            assert isinstance(llm.engine.executor.runner.model.lora, PagedLoRA) == in_place
            if paged is not None:
                pages[size] = {r.lora_int_id: len(r.block_ids) for r in llm.engine.kv_snapshot().adapters}
            assert_pool_whole(llm.engine)
        got[size] = [o.outputs[0].token_ids for o in outs]
    assert got[2] == [t for n in order for t in expected[n]]
    assert got[2] == got[1]
    if paging == "unified":  # a rank's chunks are half the KV heads' (or one copied head's)
        assert pages[2] != pages[1] and set(pages[2]) == {1, 2}


def test_a_small_pool_evicts_and_reloads_the_ranks_shards_alike(tmp_path):
    """Three adapters of 6 pages each on two ranks (their shards in half-size chunks) in a pool of
    16 blocks: they cannot all be resident beside their KV blocks, take turns, are evicted for
    each other and for KV blocks and read again on both ranks, and give PEFT's tokens each time."""
    base = make_checkpoint(tmp_path, "llama")
    prompts = [[5, 9, 14], [7, 3, 22, 30, 11, 8]]
    folders = [make_adapter(tmp_path / f"a{i}", base, seed=10 + i) for i in range(3)]
    loras = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    expected = {lora.lora_int_id: peft_greedy(base, lora.lora_path, prompts, RUN_MAX_NEW) for lora in loras}
    expected[None] = peft_greedy(base, None, prompts, RUN_MAX_NEW)  # what run_checked generates
    options = OPTIONS | {"max_loras": 3, "max_lora_rank": 4, "num_kv_blocks": 16}
    with LLM(str(base), tensor_parallel_size=2, **options) as llm:
        engine = llm.engine
        paged = engine.scheduler.paged_adapters
        order = [*loras, None, *loras, loras[0]]
        requests = [(f"{n}-{k}", p, lora) for n, lora in enumerate(order) for k, p in enumerate(prompts)]
        tokens = run_checked(engine, requests)  # checks every block's holders at every step
        assert {len(r.block_ids) for r in paged.snapshot()} == {6}
        assert paged.pages.num_evictions > 0 and paged.pages.num_loads > len(loras)
        assert_pool_whole(engine)
    for n, lora in enumerate(order):
        for k in range(len(prompts)):
            assert tokens[f"{n}-{k}"] == expected[None if lora is None else lora.lora_int_id][k]


@pytest.mark.parametrize(
    ("overrides", "size"),
    [({}, 2), ({"num_key_value_heads": 1}, 2), ({}, 4), ({"intermediate_size": 256}, 4)],
    ids=["gqa-2", "kv-head-replicated-2", "kv-heads-replicated-4", "wide-mlp-4"],
)
def test_the_control_planes_page_count_is_each_ranks_cut_in_its_chunks(tmp_path, overrides, size):
    """The engine counts an adapter's pages from the config alone; each rank's model, built as
    the ranks build it, cuts the file's tensors (the cut its pages and slots hold) to exactly
    that many pages of its own KV chunks -- on every rank, replicated KV heads included."""
    base = make_checkpoint(tmp_path, "llama", **overrides)
    folder = make_adapter(tmp_path / "a", base, seed=3, rank=8)
    whole = ModelConfig.from_pretrained(base)
    registry = LoRARegistry(LoRAConfig(max_loras=1, max_lora_rank=8), whole)
    registry.add(LoRARequest("a", 1, str(folder)))
    counted = registry.paged_file(1, 16, size).pages
    spec = read_adapter(folder, whole, 8)
    with safe_open(spec.weights_file, framework="pt") as file:
        tensors = {key: (file.get_tensor(a), file.get_tensor(b)) for key, (a, b) in spec.tensors.items()}
    backend = resolve_backend("torch", torch.device("cpu"))
    shard = shard_config(whole, size)
    chunk = chunk_elements(16, shard.num_kv_heads, shard.head_dim)
    for rank in range(size):
        model = TensorParallel(rank, size).build(whole, backend)
        slots = LoRASlots(model, 1, 8, checkpoint=whole)
        layers = [{} for _ in range(whole.num_layers)]
        for (layer, target), (a, b) in tensors.items():
            a_cut, b_cut = slots.cut(layer, target, a, b)
            layers[layer][target] = (tuple(a_cut.shape), tuple(b_cut.shape))
        assert AdapterLayout.of(layers, chunk).pages == counted, f"rank {rank} of {size}"
    unsharded = [{} for _ in range(whole.num_layers)]
    for (layer, target), (a, b) in tensors.items():
        unsharded[layer][target] = (tuple(a.shape), tuple(b.shape))
    assert counted < AdapterLayout.of(unsharded, chunk).pages  # the whole adapter would need more


def _changed(folder):
    """Rewrite ``folder``'s weights with the same names and shapes, other values (the header
    still passes the check; the CRC-32 taken when the adapter was added does not); returns
    the original bytes."""
    from safetensors.torch import load_file, save_file

    weights = folder / "adapter_model.safetensors"
    original = weights.read_bytes()
    save_file({name: 2 * t for name, t in load_file(weights).items()}, weights)
    return original


@pytest.mark.parametrize(
    ("size", "paging"),
    [(1, "unified"), (2, "unified"), (2, "slots")],
    ids=["1-unified", "2-unified", "2-slots"],
)
def test_an_adapter_whose_files_changed_fails_its_requests_and_the_ranks_serve_on(tmp_path, size, paging):
    """An adapter changed (unified paging: its file's CRC-32 differs) or moved (slots: its
    folder is gone) after it was added: every rank skips it alike, its requests end with
    ``"error"`` naming why, the other rows of the same steps are PEFT's, no rank stops, every
    block comes back; once the files are back it loads and gives PEFT's tokens (nothing of the
    failed steps was cached or kept)."""
    base, requests, prompts, expected = _case(tmp_path)
    bad = requests["qv-down"]
    options = OPTIONS | {"lora_paging": paging, "num_kv_blocks": 64}
    with LLM(str(base), tensor_parallel_size=size, **options) as llm:
        for lora in requests.values():
            llm.engine.add_lora(lora)
        folder = Path(bad.lora_path)
        if paging == "unified":
            original, reason = _changed(folder), "the file changed since the adapter was added"
        else:
            folder.rename(folder.with_name("moved"))
            reason = "does not exist"
        order = ["all", "qv-down", None]
        outs = llm.generate(
            [p for _ in order for p in prompts],
            GREEDY,
            lora_request=[None if n is None else requests[n] for n in order for _ in prompts],
            use_tqdm=False,
        )
        by_name = {n: outs[i * len(prompts) : (i + 1) * len(prompts)] for i, n in enumerate(order)}
        for name in ("all", None):
            assert [o.outputs[0].token_ids for o in by_name[name]] == expected[name]
            assert all(o.error is None for o in by_name[name])
        for out in by_name["qv-down"]:
            assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
            assert "LoRA adapter 'qv-down' could not be loaded" in out.error and reason in out.error
        llm.engine.executor.check_health()  # every rank still serves
        assert_pool_whole(llm.engine)
        if paging == "unified":
            (folder / "adapter_model.safetensors").write_bytes(original)
        else:
            folder.with_name("moved").rename(folder)
        again = llm.generate(prompts, GREEDY, lora_request=bad, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected["qv-down"]
        assert_pool_whole(llm.engine)


def test_with_a_host_tier_each_ranks_shard_comes_back_from_its_tier(tmp_path):
    """Two ranks, a host tier: an evicted adapter's pages (each rank's shard) are spilled to each
    rank's share of the tier and copied back from it, checked on each rank, with the folders
    gone -- PEFT's tokens."""
    base = make_checkpoint(tmp_path, "llama")
    prompts = [[5, 9, 14]]
    folders = [make_adapter(tmp_path / f"a{i}", base, seed=30 + i) for i in range(3)]
    loras = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    expected = {lora.lora_int_id: peft_greedy(base, lora.lora_path, prompts, RUN_MAX_NEW) for lora in loras}
    options = OPTIONS | {"max_loras": 3, "max_lora_rank": 4, "num_kv_blocks": 16}
    tier = {"kv_offload": "host", "kv_offload_memory": "1MiB"}
    with LLM(str(base), tensor_parallel_size=2, **options, **tier) as llm:
        engine = llm.engine
        first = run_checked(engine, [(f"x{n}", prompts[0], lora) for n, lora in enumerate(loras)])
        for folder in folders:  # from here on no rank can read a folder
            folder.rename(folder.with_name(f"gone-{folder.name}"))
        again, sources = {}, []
        for n, lora in enumerate(loras):  # each evicts another for the next
            again |= run_checked(engine, [(f"y{n}", prompts[0], lora)])
            resident = {a.lora_int_id: a.loaded_from for a in engine.kv_snapshot().adapters}
            sources.append(resident[lora.lora_int_id])  # idle now, still resident
        assert sources == ["tier"] * len(loras)
        assert_pool_whole(engine)
    for n, lora in enumerate(loras):
        assert first[f"x{n}"] == again[f"y{n}"] == expected[lora.lora_int_id][0]
