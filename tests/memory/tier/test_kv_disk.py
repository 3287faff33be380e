"""The disk tier: files that round-trip a block bit for bit, a scan that finds yesterday's blocks
and ignores (with a warning) every file it must not load -- another layout, torn, damaged --,
writes that a killed process leaves whole or absent, and the mover that runs a step's moves."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.memory import BlockLoad, BlockSpill, KVTransfers
from pagedkv.memory.block_hash import block_hash
from pagedkv.memory.tier.disk import CorruptBlockError, DiskKVTier, block_file_name
from pagedkv.memory.tier.host import KVLayout, gather_blocks
from pagedkv.memory.tier.movers import DiskTierMover

from .test_kv_offload import KINDS, block_bytes, random_cache

TOKENS = (1, 2, 3, 4)
DIGEST = block_hash(None, TOKENS)


def disk_tier(tmp_path, cache, model="model-a", **changes) -> DiskKVTier:
    layout = dataclasses.replace(KVLayout.of(cache, model), **changes)
    return DiskKVTier(tmp_path / "tier", layout)


def write_one(tier, cache, block=0, digest=DIGEST, parent=None, tokens=TOKENS):
    data, scales = gather_blocks(cache, [block])
    tier.write_block(digest, parent, tokens, data[0], None if scales is None else scales[0])


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), KINDS)
def test_a_block_file_round_trips_bit_for_bit_and_a_restart_finds_it(tmp_path, dtype, kv_cache_dtype):
    cache = random_cache(dtype, kv_cache_dtype)
    tier = disk_tier(tmp_path, cache)
    write_one(tier, cache, block=3)
    data, scales = tier.read_block(DIGEST)
    gathered, gathered_scales = gather_blocks(cache, [3])
    assert torch.equal(data, gathered[0])
    assert (scales is None) == (kv_cache_dtype == "auto")
    if scales is not None:
        assert torch.equal(scales, gathered_scales[0])
    restarted = DiskKVTier(tier.folder, tier.layout)  # a new process: only the folder is left
    (found,) = restarted.scan()
    assert (found.block_hash, found.parent_hash, found.token_ids) == (DIGEST, None, TOKENS)
    assert found.path.name == block_file_name(DIGEST, 0)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "model-b"},
        {"block_size": 8},
        {"dtype": "float16"},
        {"kv_cache_dtype": "fp8"},
        {"num_kv_heads": 1, "tp_size": 2},
    ],
)
def test_a_file_of_another_layout_is_ignored_with_a_warning_and_never_loaded(tmp_path, caplog, change):
    cache = random_cache(torch.float32, "auto")
    write_one(disk_tier(tmp_path, cache), cache)
    other = disk_tier(tmp_path, cache, **change)
    with caplog.at_level(logging.WARNING, "pagedkv.memory.tier.disk"):
        assert other.scan() == []
    assert "another KV layout" in caplog.text and block_file_name(DIGEST, 0) in caplog.text
    with pytest.raises(CorruptBlockError, match="another KV layout"):
        other.read_block(DIGEST)


def test_another_ranks_files_are_left_alone(tmp_path):
    cache = random_cache(torch.float32, "auto")
    write_one(disk_tier(tmp_path, cache, tp_rank=1, tp_size=2), cache)
    rank0 = disk_tier(tmp_path, cache, tp_rank=0, tp_size=2)
    assert rank0.scan() == [] and len(list(rank0.folder.iterdir())) == 1


def damage(path, how, where=0):
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        raw = raw[:where]
    elif how == "extend":
        raw += b"\0" * (where + 1)
    else:
        raw[where % len(raw)] ^= 1 << (how % 8)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("how", "where", "scan_says", "read_says"),
    [
        ("truncate", 5, "torn file", "torn file"),
        ("truncate", 100, "torn or damaged header", "torn or damaged header"),
        ("truncate", -3, "torn file", "torn file"),
        ("extend", 0, "torn file", "torn file"),
        (1, 20, "torn or damaged header", "torn or damaged header"),
        (0, 0, "magic", "magic"),
        (3, -1, None, "damaged payload"),  # the header is fine: the payload's checksum catches it
    ],
)
def test_a_torn_or_damaged_file_is_never_loaded(tmp_path, caplog, how, where, scan_says, read_says):
    cache = random_cache(torch.float32, "auto")
    tier = disk_tier(tmp_path, cache)
    write_one(tier, cache)
    path = tier.block_path(DIGEST)
    where = where if where >= 0 else path.stat().st_size + where
    damage(path, how, where)
    with caplog.at_level(logging.WARNING, "pagedkv.memory.tier.disk"):
        found = tier.scan()
    if scan_says is None:
        assert len(found) == 1  # only reading every payload would see it; every read does
    else:
        assert found == [] and scan_says in caplog.text
    with pytest.raises(CorruptBlockError, match=read_says):
        tier.read_block(DIGEST)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_to_a_file_is_refused_never_read_as_other_bytes(tmp_path, data):
    cache = random_cache(torch.bfloat16, "int8", seed=data.draw(st.integers(0, 5)))
    tier = disk_tier(tmp_path, cache)
    write_one(tier, cache)
    path = tier.block_path(DIGEST)
    original = tier.read_block(DIGEST)
    size = path.stat().st_size
    how = data.draw(st.sampled_from(["truncate", "extend", "flip"]))
    where = data.draw(st.integers(0, size - 1))
    damage(path, data.draw(st.integers(0, 7)) if how == "flip" else how, where)
    try:
        got = tier.read_block(DIGEST)
    except CorruptBlockError:
        return
    assert torch.equal(got[0], original[0]) and torch.equal(got[1], original[1])


def test_a_header_naming_another_block_is_refused(tmp_path, caplog):
    cache = random_cache(torch.float32, "auto")
    tier = disk_tier(tmp_path, cache)
    write_one(tier, cache)
    tier.block_path(DIGEST).rename(tier.block_path(DIGEST + 1))
    with caplog.at_level(logging.WARNING, "pagedkv.memory.tier.disk"):
        assert tier.scan() == []
    assert "names another block" in caplog.text
    with pytest.raises(CorruptBlockError, match="not block"):
        tier.read_block(DIGEST + 1)


def test_the_scan_removes_temporaries_and_swap_files_a_crash_left(tmp_path):
    cache = random_cache(torch.float32, "auto")
    tier = disk_tier(tmp_path, cache)
    write_one(tier, cache)
    data, scales = gather_blocks(cache, [1])
    tier.write_swap(5, data[0], scales)
    (tier.folder / ".tmp-0000000000000001.r0.kvblock-abc").write_bytes(b"half a blo")
    (tier.folder / "notes.txt").write_text("not ours")
    assert [b.block_hash for b in tier.scan()] == [DIGEST]
    assert sorted(p.name for p in tier.folder.iterdir()) == [block_file_name(DIGEST, 0), "notes.txt"]


WRITER = textwrap.dedent(
    """
    import sys, torch
    from pagedkv.memory.tier.disk import DiskKVTier
    from pagedkv.memory.tier.host import KVLayout
    layout = KVLayout(**eval(sys.argv[2]))
    tier = DiskKVTier(sys.argv[1], layout)
    data = torch.zeros(layout.data_shape, dtype=torch.uint8)
    for i in range(10**9):
        data.fill_(i % 251)
        tier.write_block(7, None, (i % 251,), data, None)   # one name, rewritten over and over
        if i == 0:
            print("written", flush=True)
    """
)


def test_a_process_killed_mid_write_leaves_a_whole_file(tmp_path):
    """Kill -9 a process that rewrites one block file as fast as it can: whatever moment the
    kill lands, the file that is left reads back whole, and the scan clears the debris."""
    cache = random_cache(torch.float32, "auto", num_blocks=2, block_size=64)
    layout = KVLayout.of(cache, "model-a")
    folder = tmp_path / "tier"
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(folder), repr(layout.to_dict())],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "written\n"  # the first file is whole: now kill it mid-loop
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    tier = DiskKVTier(folder, layout)
    (found,) = tier.scan()
    data, _ = tier.read_block(7)
    assert bool((data == found.token_ids[0]).all())  # one write's bytes, all of them
    assert [p.name for p in folder.iterdir()] == [block_file_name(7, 0)]


def test_the_mover_writes_in_the_background_and_loads_what_it_is_asked(tmp_path, caplog):
    cache = random_cache(torch.float32, "int8")
    mover = DiskTierMover(disk_tier(tmp_path, cache))
    try:
        before = {block: block_bytes(cache, block) for block in range(cache.num_blocks)}
        spill = BlockSpill(2, 10, DIGEST, None, TOKENS)
        mover.store(cache, KVTransfers(spills=[spill], swap_outs=[(5, 11)]))
        mover.drain()
        assert sorted(mover.take_stored()) == [(10, True), (11, True)]
        loaded = mover.load(cache, KVTransfers(loads=[BlockLoad(10, 6, DIGEST)], swap_ins=[(11, 7)]))
        assert loaded == [(10, True), (11, True)]
        assert block_bytes(cache, 6) == before[2] and block_bytes(cache, 7) == before[5]
        mover.drain()
        assert not mover.tier.swap_path(11).exists()  # swapped in: its file is done with
        damage(mover.tier.block_path(DIGEST), 0, -1)
        with caplog.at_level(logging.WARNING, "pagedkv.memory.tier.movers"):
            assert mover.load(cache, KVTransfers(loads=[BlockLoad(10, 1, DIGEST)])) == [(10, False)]
        assert block_bytes(cache, 1) == before[1] and "damaged payload" in caplog.text
        mover.store(cache, KVTransfers(forgotten=[DIGEST]))
        mover.drain()
        assert not mover.tier.block_path(DIGEST).exists()
    finally:
        mover.close()


def test_the_mover_refuses_writes_past_its_queue_budget_at_once(tmp_path):
    cache = random_cache(torch.float32, "auto")
    tier = disk_tier(tmp_path, cache)
    mover = DiskTierMover(tier, max_pending_bytes=tier.layout.block_bytes)
    try:
        spills = [BlockSpill(b, b, block_hash(None, (b,) * 4), None, (b,) * 4) for b in range(3)]
        mover.store(cache, KVTransfers(spills=spills))
        mover.drain()
        assert sorted(mover.take_stored()) == [(0, True), (1, False), (2, False)]
        assert mover.writes_refused == 2 and len(tier.scan()) == 1
    finally:
        mover.close()
