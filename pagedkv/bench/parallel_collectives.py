"""The all-reduces of a tensor-parallel step timed alone: two ranks, nothing else to wait for.

Inside a step, rank 0's time in a collective includes waiting for the other rank to arrive
(whatever imbalance or background load delayed it). Here both ranks start each round together
(a barrier) and do nothing but all-reduce a ``[tokens, hidden]`` float tensor, so the figure is
the collective's own cost; a step makes ``2 * layers + 1`` of them.
"""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedkv.distributed.rendezvous import free_port


def _rounds(rank: int, world: int, port: int, shapes: list[tuple[int, int]], repeats: int) -> list[float]:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )
    try:
        seconds = []
        for shape in shapes:
            tensor = torch.ones(shape)
            dist.all_reduce(tensor)  # warm the connection
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                started = time.perf_counter()
                dist.all_reduce(tensor)
                best = min(best, time.perf_counter() - started)
            seconds.append(best)
        return seconds
    finally:
        dist.destroy_process_group()


def time_all_reduces(shapes: list[tuple[int, int]], repeats: int = 20, world: int = 2) -> list[float]:
    """Seconds of one all-reduce of each shape among ``world`` ranks (best of ``repeats``,
    the least disturbed by other work); rank 0 here, the others spawned. Call it with no
    tensor-parallel engine alive in this process."""
    port = free_port("127.0.0.1")
    context = multiprocessing.get_context("spawn")
    others = [
        context.Process(target=_rounds, args=(rank, world, port, shapes, repeats), daemon=True)
        for rank in range(1, world)
    ]
    for process in others:
        process.start()
    try:
        return _rounds(0, world, port, shapes, repeats)
    finally:
        for process in others:
            process.join(30)
            if process.is_alive():
                process.kill()
