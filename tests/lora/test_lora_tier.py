"""Unified paging with a second KV tier: an idle adapter evicted from the pool is spilled to the
tier and comes back from it, its folder not read again (one evicted and needed again within a
single step is read from its folder: its spill is not readable yet); a copy that fails a check (a damaged disk
file, host bytes that are not what was written) is forgotten and the folder read instead, with
PEFT's tokens either way; at every step each block's refcount is its holders' and every tier slot
has one owner; removing an adapter drops its tier entries."""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from pathlib import Path

import pytest

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.engine.lora_registry import weights_checksum
from pagedkv.memory.tier.adapter_entries import page_entry
from pagedkv.memory.tier.disk import block_file_name
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter, peft_greedy
from tests.lora_runs import check_holders
from tests.server.helpers import assert_pool_whole

MAX_NEW = 5
PROMPT = [5, 9, 14]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
#: Four rank-4 adapters of 4 pages each do not fit at once in 16 blocks: they take turns.
OPTIONS = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=4, num_kv_blocks=16)
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A checkpoint, four adapter folders and PEFT's tokens for each."""
    tmp = tmp_path_factory.mktemp("lora-tier")
    base = make_checkpoint(tmp, "llama")
    folders = [make_adapter(tmp / f"a{i}", base, seed=20 + i) for i in range(4)]
    expected = [peft_greedy(base, folder, [PROMPT], MAX_NEW)[0] for folder in folders]
    return base, folders, expected


def _adapters(folders: list[Path], tmp_path: Path) -> list[LoRARequest]:
    """Copies of the adapter folders (a test may move them away), as requests."""
    copies = [shutil.copytree(folder, tmp_path / folder.name) for folder in folders]
    return [LoRARequest(f"a{i}", i + 1, str(copy)) for i, copy in enumerate(copies)]


def _check_tier(engine) -> None:
    """Every slot of the tier is free or has exactly one owner, adapters' pages included."""
    tier = engine.kv_manager.tier
    owners, free = tier.slot_owners(), tier.free_slots()
    assert not set(owners) & set(free) and sorted([*owners, *free]) == list(range(tier.capacity))


def _run(engine, loras: list[LoRARequest], steps: Counter) -> list[list[int]]:
    """One request per adapter, run to the end; the step stats summed into ``steps``."""
    for n, lora in enumerate(loras):
        engine.add_request(str(n), PROMPT, GREEDY, lora_request=lora)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        check_holders(engine)
        _check_tier(engine)
        step = engine.last_step
        for name in ("lora_page_tier_loads", "lora_page_file_reads", "lora_page_tier_fallbacks"):
            steps[name] += getattr(step, name)
        steps["spills"] += step.lora_page_spills
    return [tokens[str(n)] for n in range(len(loras))]


def _tier_slots(engine, lora: LoRARequest, pages: int) -> list[int]:
    """The tier slots of ``lora``'s readable pages (of ``pages``)."""
    crc = weights_checksum(Path(lora.lora_path) / WEIGHTS)
    entries = [engine.kv_manager.tier.get(page_entry(lora.lora_int_id, crc, i)[0]) for i in range(pages)]
    return [entry.slot for entry in entries if entry is not None and entry.readable]


def test_adapters_taking_turns_come_back_from_the_tier_without_their_folders(case, tmp_path):
    base, folders, expected = case
    loras = _adapters(folders, tmp_path)
    with LLM(str(base), **OPTIONS, kv_offload="host", kv_offload_memory="1MiB") as llm:
        engine = llm.engine
        first: Counter = Counter()
        assert _run(engine, loras, first) == expected
        assert first["lora_page_file_reads"] == 4 and first["spills"] > 0
        for lora in loras:  # no folder can be read from here on
            Path(lora.lora_path).rename(tmp_path / f"gone-{lora.lora_name}")
        again: Counter = Counter()
        for lora, tokens in zip(loras, expected, strict=True):  # each evicts an adapter for the next
            assert _run(engine, [lora], again) == [tokens]
        assert again["lora_page_tier_loads"] >= 3
        assert again["lora_page_file_reads"] == again["lora_page_tier_fallbacks"] == 0
        assert {a.loaded_from for a in engine.kv_snapshot().adapters} == {"tier"}
        assert_pool_whole(engine)


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_a_damaged_tier_copy_is_forgotten_and_the_folder_read_instead(case, tmp_path, medium, caplog):
    base, folders, expected = case
    loras = _adapters(folders, tmp_path)
    tier = dict(kv_offload=medium, kv_offload_memory="1MiB")
    if medium == "disk":
        tier["kv_offload_dir"] = str(tmp_path / "kv")
    with LLM(str(base), **OPTIONS, **tier) as llm:
        engine = llm.engine
        steps: Counter = Counter()
        assert _run(engine, loras, steps) == expected  # the first adapters are evicted for the last
        runner_tier = engine.executor.runner.tier
        runner_tier.drain()  # a disk tier's files written, then acknowledged
        engine.kv_tier.settle_moves()
        victim = loras[0]
        assert not engine.scheduler.paged_adapters.pages.is_resident(victim.lora_int_id)
        pages = engine.scheduler.paged_adapters.pages_of(victim.lora_int_id)
        slots = _tier_slots(engine, victim, pages)
        assert len(slots) == pages
        if medium == "host":
            runner_tier.mover.tier.data[slots[-1]].view(-1)[-1] ^= 1  # one bit of the last page
        else:
            crc = weights_checksum(Path(victim.lora_path) / WEIGHTS)
            path = tmp_path / "kv" / block_file_name(page_entry(victim.lora_int_id, crc, 1)[0], 0)
            data = bytearray(path.read_bytes())
            data[-1] ^= 1
            path.write_bytes(bytes(data))
        steps.clear()
        with caplog.at_level(logging.WARNING):
            assert _run(engine, [victim], steps) == expected[:1]
        assert (steps["lora_page_tier_loads"], steps["lora_page_tier_fallbacks"]) == (1, 1)
        assert "not using its copy from the KV tier" in caplog.text
        assert len(_tier_slots(engine, victim, pages)) < pages  # the bad copy is forgotten
        assert_pool_whole(engine)


def test_removing_an_adapter_drops_its_tier_entries(case, tmp_path):
    base, folders, expected = case
    loras = _adapters(folders, tmp_path)
    with LLM(str(base), **OPTIONS, kv_offload="host", kv_offload_memory="1MiB") as llm:
        engine = llm.engine
        assert _run(engine, loras, Counter()) == expected
        victim = loras[0]
        pages = engine.scheduler.paged_adapters.pages_of(victim.lora_int_id)
        assert len(_tier_slots(engine, victim, pages)) == pages
        before = engine.kv_manager.tier.num_blocks
        assert engine.remove_lora(victim.lora_int_id)
        assert not _tier_slots(engine, victim, pages)
        assert engine.kv_manager.tier.num_blocks == before - pages
        _check_tier(engine)
        assert_pool_whole(engine)


def test_a_restarted_disk_tier_gives_back_the_adapters_of_the_last_run(case, tmp_path):
    """The pages of adapters evicted before a restart, and of those resident when the engine
    stopped, are files of the disk tier: the next engine indexes them, and loads them (reading
    only the folder's config and header for their layout) with PEFT's tokens."""
    base, folders, expected = case
    loras = _adapters(folders, tmp_path)
    tier = dict(kv_offload="disk", kv_offload_memory="1MiB", kv_offload_dir=str(tmp_path / "kv"))
    with LLM(str(base), **OPTIONS, **tier) as llm:
        assert _run(llm.engine, loras, Counter()) == expected
        paged = llm.engine.scheduler.paged_adapters
        evicted, resident = loras[0], loras[-1]
        assert not paged.pages.is_resident(evicted.lora_int_id)
        assert paged.pages.is_resident(resident.lora_int_id)
    with LLM(str(base), **OPTIONS, **tier) as llm:
        steps: Counter = Counter()
        for lora in (evicted, resident):
            assert _run(llm.engine, [lora], steps) == [expected[loras.index(lora)]]
        assert (steps["lora_page_tier_loads"], steps["lora_page_file_reads"]) == (2, 0)
        assert_pool_whole(llm.engine)
