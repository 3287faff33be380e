"""Joining the tensor-parallel process group, with timeouts, and the two groups a rank uses.

``compute``: the collectives of the forward pass (all-reduce, gather); NCCL on CUDA, gloo on
CPU; a collective that waits longer than ``distributed_timeout`` fails, so a rank that died or
hangs stops the others within that time instead of forever. ``control``: a gloo group that
carries each step's plan from rank 0. Its timeout is very long on purpose: a worker waits in it
while the engine is idle, which may be for days.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pagedkv.distributed.rendezvous import Rendezvous

#: How long a worker may wait for the next plan (an idle server): effectively forever.
IDLE_TIMEOUT = timedelta(days=3650)


@dataclass(frozen=True)
class Groups:
    compute: Any
    control: Any
    rank: int
    world_size: int


def join(rendezvous: Rendezvous, rank: int, device_type: str) -> Groups:
    """Join the group as ``rank``; blocks until every rank has joined (at most the timeout)."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: one engine with "
            "tensor_parallel_size > 1 per process"
        )
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=rendezvous.init_method,
        rank=rank,
        world_size=rendezvous.world_size,
        timeout=timedelta(seconds=rendezvous.timeout),
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Groups(dist.group.WORLD, control, rank, rendezvous.world_size)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def send_object(groups: Groups, value: Any) -> None:
    """Rank 0: send ``value`` (picklable) to every other rank."""
    dist.broadcast_object_list([value], src=0, group=groups.control)


def receive_object(groups: Groups) -> Any:
    """Other ranks: the next value rank 0 sends (waits as long as the engine is idle)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=groups.control)
    return box[0]
