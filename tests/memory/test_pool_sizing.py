"""The KV pool's default size, as a rule of the memory left and the model's facts; and the
memory probes it starts from."""

from __future__ import annotations

import pytest

from pagedkv.memory import pool_sizing
from pagedkv.memory.pool_sizing import (
    AUTO_KV_SHARE,
    PoolSizing,
    auto_pool_blocks,
    available_host_memory,
    kv_cache_bytes,
)

MiB, GiB = 2**20, 2**30
#: a model whose block takes 32 KiB; max_model_len 4096 in blocks of 16: 256 blocks a context
MODEL = dict(block_bytes=32 * 1024, block_size=16, max_model_len=4096, max_num_seqs=64)
CONTEXT_BLOCKS, CAP_BLOCKS = 256, 64 * 256


def test_half_of_what_is_left_when_that_is_between_one_context_and_the_batch():
    assert AUTO_KV_SHARE == 0.5
    assert auto_pool_blocks(256 * MiB, **MODEL) == 128 * MiB // (32 * 1024) == 4096


def test_a_big_machine_gives_a_small_model_only_what_its_batch_can_fill():
    assert auto_pool_blocks(2**40, **MODEL) == CAP_BLOCKS
    assert auto_pool_blocks(2**40, **(MODEL | {"max_num_seqs": 4, "max_model_len": 100})) == 4 * 7


def test_a_tight_machine_still_gives_one_full_context():
    # half of 10 MiB is 160 blocks, fewer than the 256 one request at max_model_len needs
    assert auto_pool_blocks(10 * MiB, **MODEL) == CONTEXT_BLOCKS


def test_floor_and_cap_count_a_request_by_the_blocks_it_holds_at_its_peak():
    """With KV groups one full-context request holds more blocks than its tokens fill (one table
    per group): floor and cap count those."""
    assert auto_pool_blocks(10 * MiB, **MODEL, request_blocks=300) == 300
    assert auto_pool_blocks(2**40, **MODEL, request_blocks=300) == 64 * 300


def test_less_than_one_context_refuses_to_start_naming_what_shrinks_it():
    with pytest.raises(ValueError, match="max_model_len 4096") as err:
        auto_pool_blocks(4 * MiB, **MODEL)
    assert "--max-model-len" in str(err.value) and "--kv-cache-memory" in str(err.value)


def test_ranks_of_one_machine_split_the_share():
    one = auto_pool_blocks(256 * MiB, **MODEL)
    assert auto_pool_blocks(256 * MiB, **MODEL, ranks_sharing=2) == one // 2
    with pytest.raises(ValueError, match="for 2 ranks"):  # each rank's half holds no context
        auto_pool_blocks(12 * MiB, **MODEL, ranks_sharing=2)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", None), (" AUTO ", None), ("2GiB", 2 * GiB), ("512MB", 512 * 10**6), (4096, 4096)],
)
def test_kv_cache_memory_is_auto_or_a_size(value, expected):
    assert kv_cache_bytes(value) == expected


@pytest.mark.parametrize("value", ["lots", "0", -1])
def test_kv_cache_memory_refuses_anything_else(value):
    with pytest.raises(ValueError):
        kv_cache_bytes(value)


def test_the_start_up_line_says_the_pool_and_where_it_came_from():
    auto = PoolSizing(4096, 16, 32 * 1024, "auto", available=3 * GiB)
    assert auto.nbytes == 128 * MiB and auto.tokens == 4096 * 16
    assert auto.describe() == (
        "KV cache: 4096 blocks of 16 tokens (128.0 MiB, 65536 tokens), sized auto from 3.00 GiB available"
    )
    given = PoolSizing(65536, 16, 32 * 1024, "kv_cache_memory", ranks=2)
    assert given.describe() == (
        "KV cache: 65536 blocks of 16 tokens (2.00 GiB per rank, 1048576 tokens), from --kv-cache-memory"
    )


def test_host_memory_is_what_the_kernel_says_is_available():
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    available = available_host_memory()
    assert 0 < available <= info["MemTotal"]


def _cgroup(tmp_path, limit: str, usage: int, inactive_file: int) -> None:
    (tmp_path / "limit").write_text(limit + "\n")
    (tmp_path / "usage").write_text(f"{usage}\n")
    (tmp_path / "stat").write_text(f"anon 1\ninactive_file {inactive_file}\nactive_file 5\n")


def test_a_container_limit_bounds_the_host_memory(tmp_path, monkeypatch):
    files = tuple(str(tmp_path / name) for name in ("limit", "usage", "stat"))
    monkeypatch.setattr(pool_sizing, "_CGROUP_FILES", (files,))
    monkeypatch.setattr(pool_sizing, "_meminfo_available", lambda: 8 * GiB)
    # 1 GiB limit, 700 MiB used of which 200 MiB is page cache the kernel reclaims first: 524 MiB left
    _cgroup(tmp_path, str(GiB), 700 * MiB, 200 * MiB)
    assert available_host_memory() == 524 * MiB
    _cgroup(tmp_path, "max", 700 * MiB, 0)  # cgroup v2 without a limit: the host's figure
    assert available_host_memory() == 8 * GiB
    _cgroup(tmp_path, str(2**63 - 4096), 700 * MiB, 0)  # v1 says "no limit" with a huge number
    assert available_host_memory() == 8 * GiB
