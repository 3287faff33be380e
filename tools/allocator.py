"""Time the block allocator on the operations the engine performs most.

Appends 1,000,000 tokens one at a time across 1,000 block tables, forks every table, writes one
token into each child (a copy-on-write of its partial last block), then frees everything. The
baseline, run in the same process, is the floor any allocator pays in this loop: appending the
token to a plain Python list per table. The ratio says what paging costs on top of that.

    .venv/bin/python tools/allocator.py [--tokens 1000000] [--tables 1000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from pagedkv.memory import BlockPool, BlockTable


def _ns_per_op(seconds: float, ops: int) -> float:
    return seconds * 1e9 / ops


def run(num_tokens: int, num_tables: int, block_size: int) -> dict[str, float]:
    per_table = num_tokens // num_tables
    blocks_per_table = -(-per_table // block_size)
    pool = BlockPool(num_tables * (blocks_per_table + 1) * 2, block_size)
    tables = [BlockTable(pool) for _ in range(num_tables)]

    start = time.perf_counter()
    for _ in range(per_table):
        for table in tables:
            table.append_slots(1)
    append_s = time.perf_counter() - start

    floor = [[] for _ in range(num_tables)]
    start = time.perf_counter()
    for step in range(per_table):
        for tokens in floor:
            tokens.append(step)
    floor_s = time.perf_counter() - start

    start = time.perf_counter()
    children = [table.fork() for table in tables]
    fork_s = time.perf_counter() - start

    start = time.perf_counter()
    copies = sum(len(child.append_slots(1)) for child in children)
    cow_s = time.perf_counter() - start

    start = time.perf_counter()
    for table in tables + children:
        table.free()
    free_s = time.perf_counter() - start
    assert pool.num_used_blocks == 0, "blocks leaked"

    total = per_table * num_tables
    return {
        "append ns/token": _ns_per_op(append_s, total),
        "floor ns/token (list.append)": _ns_per_op(floor_s, total),
        "append / floor": append_s / floor_s,
        "fork ns/table": _ns_per_op(fork_s, num_tables),
        "fork ns/block": _ns_per_op(fork_s, num_tables * blocks_per_table),
        "copy-on-write append ns": _ns_per_op(cow_s, num_tables),
        "copies made": copies,
        "free ns/block": _ns_per_op(free_s, pool.num_blocks // 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--tables", type=int, default=1_000)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    for name, value in run(args.tokens, args.tables, args.block_size).items():
        print(f"{name:32s} {value:12.1f}")


if __name__ == "__main__":
    main()
