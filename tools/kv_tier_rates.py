"""How fast KV blocks move to and from the second tier: the rates the swap cost model wants.

    .venv/bin/python tools/kv_tier_rates.py [--device cpu|cuda] [--layers 32] [--kv-heads 8]
        [--head-dim 128] [--block-size 16] [--dtype bfloat16] [--kv-cache-dtype auto]
        [--blocks 32] [--repeats 5] [--disk-dir DIR]

Host tier: :func:`store_blocks` (pool -> tier) and :func:`load_blocks` (tier -> pool) of a
batch of ``--blocks`` scattered blocks; the best of ``--repeats`` (on CUDA each timed call ends
with a synchronization). Disk tier: ``--blocks`` block files written as the tier writes them
(temporary file, fsync, rename, folder fsync) and read back with their checksums checked, after
asking the kernel to drop those files from its page cache (``posix_fadvise``), so the reads
come from the disk. One line per figure, in bytes per second and per block.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import torch

from pagedkv.attention import KVCache
from pagedkv.memory import BlockLoad, BlockSpill, KVTransfers
from pagedkv.memory.block_hash import block_hash
from pagedkv.memory.kv_bytes import KVSpec
from pagedkv.memory.tier.disk import DiskKVTier
from pagedkv.memory.tier.host import HostKVTier, KVLayout, gather_blocks, load_blocks, store_blocks
from pagedkv.memory.tier.movers import DiskTierMover

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def best_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def report(name: str, num_bytes: int, seconds: float, blocks: int) -> None:
    print(
        f"{name:<34} {num_bytes / seconds / 1e9:8.2f} GB/s   {seconds / blocks * 1e6:9.1f} us/block   "
        f"({blocks} blocks, {num_bytes / 2**20:.1f} MiB, {seconds * 1e3:.1f} ms)"
    )


def host_rates(cache: KVCache, blocks: int, repeats: int) -> None:
    tier = HostKVTier.for_cache(cache, blocks)
    ids = torch.randperm(cache.num_blocks)[:blocks].tolist()
    slots = torch.randperm(blocks).tolist()
    out = list(zip(ids, slots, strict=True))
    back = list(zip(slots, ids, strict=True))
    size = blocks * tier.layout.block_bytes
    report(
        "host tier store (pool -> tier)",
        size,
        best_seconds(lambda: store_blocks(cache, tier, out), repeats, cache.device),
        blocks,
    )
    report(
        "host tier load (tier -> pool)",
        size,
        best_seconds(lambda: load_blocks(tier, cache, back), repeats, cache.device),
        blocks,
    )


def disk_rates(cache: KVCache, blocks: int, folder: str) -> None:
    tier = DiskKVTier(folder, KVLayout.of(cache, "benchmark"))
    data, scales = gather_blocks(cache, list(range(blocks)))
    digests = [block_hash(None, [i]) for i in range(blocks)]
    start = time.perf_counter()
    for i, digest in enumerate(digests):
        tier.write_block(digest, None, (i,), data[i], None if scales is None else scales[i])
    written = time.perf_counter() - start
    size = blocks * tier.layout.block_bytes
    report("disk tier write (+fsync, rename)", size, written, blocks)
    for digest in digests:  # the reads must come from the disk, not the page cache
        fd = os.open(tier.block_path(digest), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    start = time.perf_counter()
    for digest in digests:
        tier.read_block(digest)
    report("disk tier read (cold, checked)", size, time.perf_counter() - start, blocks)
    start = time.perf_counter()
    for digest in digests:
        tier.read_block(digest)
    report("disk tier read (page cache, checked)", size, time.perf_counter() - start, blocks)
    mover_rates(cache, tier, blocks)


def mover_rates(cache: KVCache, tier: DiskKVTier, blocks: int) -> None:
    """What a step sees: :class:`DiskTierMover` writing with its threads, reading in parallel."""
    mover = DiskTierMover(tier, max_pending_bytes=2 * blocks * tier.layout.block_bytes)
    try:
        spills = [BlockSpill(i, i, block_hash(None, [-i]), None, (-i,)) for i in range(blocks)]
        start = time.perf_counter()
        mover.store(cache, KVTransfers(spills=spills))
        handed = time.perf_counter() - start
        mover.drain()
        written = time.perf_counter() - start
        size = blocks * tier.layout.block_bytes
        report("mover: step's share of a spill", size, handed, blocks)
        report(f"mover: files written ({mover.write_threads} threads)", size, written, blocks)
        for spill in spills:
            fd = os.open(tier.block_path(spill.block_hash), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        loads = [BlockLoad(i, blocks + i, s.block_hash) for i, s in enumerate(spills)]
        start = time.perf_counter()
        assert all(ok for _, ok in mover.load(cache, KVTransfers(loads=loads)))
        report("mover: cold loads (parallel reads)", size, time.perf_counter() - start, blocks)
    finally:
        mover.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"])
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--disk-dir", default=None, help="a folder on the disk to measure (default: a temporary one)"
    )
    args = parser.parse_args()
    spec = KVSpec(args.layers, args.kv_heads, args.head_dim, "float32")
    device = torch.device(args.device)
    cache = KVCache(spec, 2 * args.blocks, args.block_size, DTYPES[args.dtype], device, args.kv_cache_dtype)
    cache.data.view(torch.uint8).random_(0, 256)
    print(f"{cache!r}, {KVLayout.of(cache, '').block_bytes} bytes per block")
    host_rates(cache, args.blocks, args.repeats)
    folder = args.disk_dir or tempfile.mkdtemp(prefix="pagedkv-tier-rates-")
    try:
        disk_rates(cache, args.blocks, folder)
    finally:
        if args.disk_dir is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
