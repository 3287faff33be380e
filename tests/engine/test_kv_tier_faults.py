"""A disk tier that cannot write (a full disk) costs the engine its spills, never its answers.

Every write fails with ENOSPC: the engine keeps serving, its greedy tokens are those of an
engine without a tier, and the log holds a bounded number of lines however many writes failed,
the last counting the failures no line was written for.
"""

from __future__ import annotations

import errno
import logging
import random
import time

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.log_limits import LOG_INTERVAL_S
from pagedkv.memory.tier import disk as kv_disk
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
#: A pool of 16 blocks of 4 tokens for prompts of 41: blocks leave it all the time.
TIGHT = dict(dtype="float32", block_size=4, num_kv_blocks=16, watermark=0.0, decode_headroom=0.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tier-faults"), "llama")


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(41)] for _ in range(8)]


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def test_a_full_disk_costs_spills_not_tokens_and_logs_a_bounded_count(
    model_path, tmp_path, caplog, monkeypatch
):
    with LLM(str(model_path), **TIGHT) as plain:
        expected = _greedy(plain)

    def full_disk(path, pieces):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(kv_disk, "write_atomically", full_disk)
    options = TIGHT | dict(kv_offload="disk", kv_offload_memory="2MiB", kv_offload_dir=tmp_path / "kv")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), LLM(str(model_path), **options) as llm:
        assert _greedy(llm) == expected
        assert _greedy(llm) == expected  # again: nothing came back from the tier, all recomputed
        stats = llm.kv_stats()
        assert stats["tier_hits_tokens"] == 0 and stats["blocks_used"] == 0
    elapsed = time.monotonic() - started
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedkv.memory.tier.movers"]
    written = [line for line in lines if "could not write" in line]
    assert 1 <= len(written) <= 1 + int(elapsed // LOG_INTERVAL_S) + 1
    held = int(
        lines[-1].split(" more failed writes since the last line of each was logged")[0].rsplit(" ", 1)[1]
    )
    assert held > len(written)  # many writes failed, few lines said so, the last counting the rest
