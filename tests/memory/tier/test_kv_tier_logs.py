"""The disk tier's warnings stay bounded while a condition lasts, and nothing is lost.

A folder full of another model's files is one line at start-up, counting them by reason with an
example; a tier whose every write fails (a full disk) writes a line per interval, not per write,
each counting the failures held back, and the mover's close reports the rest. Timing-proof: the
assertions count what the lines account for, whatever the clock did meanwhile.
"""

from __future__ import annotations

import errno
import logging
import re
import time

import torch

from pagedkv.log_limits import LOG_INTERVAL_S, Throttle
from pagedkv.memory import BlockSpill, KVTransfers
from pagedkv.memory.block_hash import block_hash
from pagedkv.memory.tier import disk as kv_disk
from pagedkv.memory.tier.disk import block_file_name
from pagedkv.memory.tier.movers import DiskTierMover

from .test_kv_disk import disk_tier, write_one
from .test_kv_offload import random_cache

FOREIGN = 500


def _lines(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.WARNING]


def test_a_folder_of_another_models_files_is_one_line_counting_them(tmp_path, caplog):
    cache = random_cache(torch.float32, "auto")
    theirs = disk_tier(tmp_path, cache, model="model-b")
    write_one(theirs, cache)
    original = theirs.block_path(block_hash(None, (1, 2, 3, 4))).read_bytes()
    for i in range(FOREIGN):  # another model's blocks, under names a scan of this rank reads
        (theirs.folder / block_file_name(10_000 + i, 0)).write_bytes(original)
    for i in range(2):
        (theirs.folder / block_file_name(20_000 + i, 0)).write_bytes(original[:100])  # torn
    ours = disk_tier(tmp_path, cache, model="model-a")
    with caplog.at_level(logging.WARNING, "pagedkv.memory.tier.disk"):
        assert ours.scan() == []
    (line,) = _lines(caplog, "pagedkv.memory.tier.disk")
    assert f"not loading {FOREIGN + 3} files of {ours.folder}" in line
    assert f"{FOREIGN + 1} written for another KV layout" in line and "2 torn or damaged" in line
    assert re.search(r"e\.g\. \S+\.kvblock: ", line)  # one example, with its reason in full


def test_writes_failing_on_a_full_disk_log_a_line_per_interval_and_count_the_rest(
    tmp_path, caplog, monkeypatch
):
    def full_disk(path, pieces):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(kv_disk, "write_atomically", full_disk)
    cache = random_cache(torch.float32, "auto")
    mover = DiskTierMover(disk_tier(tmp_path, cache))
    writes, steps = 0, 40
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "pagedkv.memory.tier.movers"):
        try:
            for step in range(steps):  # every step spills blocks, as a busy engine does
                spills = [BlockSpill(b, b, block_hash(None, (step, b)), None, (step, b)) for b in range(4)]
                mover.store(cache, KVTransfers(spills=spills))
                mover.drain()
                assert sorted(mover.take_stored()) == [(b, False) for b in range(4)]  # reported, not lost
                writes += len(spills)
            elapsed = time.monotonic() - started
            assert mover.writes_failed == writes
        finally:
            mover.close()
    lines = _lines(caplog, "pagedkv.memory.tier.movers")
    written = [line for line in lines if "could not write" in line]
    assert 1 <= len(written) <= 1 + int(elapsed // LOG_INTERVAL_S) + 1
    assert "No space left on device" in written[0]
    # the last line, at close, counts every failure no line was written for
    assert lines[-1].endswith(
        f"{writes - len(written)} more failed writes since the last line of each was logged"
    )


def test_each_line_counts_the_failures_held_back_since_the_last():
    interval = LOG_INTERVAL_S
    now = [0.0]
    throttle = Throttle(interval, clock=lambda: now[0])
    assert throttle.admit("write") == 0  # the first passes
    assert [throttle.admit("write") for _ in range(5)] == [None] * 5  # held back, counted
    assert throttle.admit("read") == 0  # another kind has its own interval
    now[0] += interval
    assert throttle.admit("write") == 5
    assert throttle.admit("write") is None
    assert throttle.take_held() == {"write": 1} and throttle.take_held() == {}
