"""Joining the tensor-parallel process group, with timeouts, and the two groups a rank uses.

``compute``: the collectives of the forward pass (all-reduce, gather); NCCL on CUDA, gloo on
CPU; a collective that waits longer than ``distributed_timeout`` fails, so a rank that died or
hangs stops the others within that time instead of forever. ``control`` (the default group,
gloo): carries each step's plan from rank 0. Its timeout is very long on purpose: a worker waits
in it while the engine is idle, which may be for days. Ranks meet through torch's ``TCPStore``
on rank 0's machine (or torchrun's own store), waiting up to :data:`STARTUP_TIMEOUT` for each
other: starting a rank imports torch and loads its shard, which may take far longer than a step.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedkv.distributed.rendezvous import Rendezvous

#: How long a worker may wait for the next plan (an idle server): effectively forever.
IDLE_TIMEOUT = timedelta(days=3650)
#: How long the ranks wait for each other to start.
STARTUP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class Groups:
    compute: Any
    control: Any
    rank: int
    world_size: int


def store(rendezvous: Rendezvous, rank: int | None) -> dist.TCPStore:
    """The rendezvous store: rank 0 hosts it, unless torchrun's agent already does; ``rank``
    None: a client only (heartbeats, rank 0 reading them)."""
    agent = rendezvous.external and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(
        rendezvous.master_addr,
        rendezvous.master_port,
        rendezvous.world_size,
        is_master=rank == 0 and not agent,
        timeout=STARTUP_TIMEOUT,
        wait_for_workers=False,
    )


def join(rendezvous: Rendezvous, rank: int, device_type: str, meeting: dist.Store | None = None) -> Groups:
    """Join the group as ``rank`` through ``meeting`` (default: a new :func:`store`); blocks
    until every rank has joined."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: one engine with "
            "tensor_parallel_size > 1 per process"
        )
    dist.init_process_group(
        "gloo",
        store=meeting if meeting is not None else store(rendezvous, rank),
        rank=rank,
        world_size=rendezvous.world_size,
        timeout=IDLE_TIMEOUT,
    )
    backend = "nccl" if device_type == "cuda" else "gloo"
    compute = dist.new_group(backend=backend, timeout=timedelta(seconds=rendezvous.timeout))
    return Groups(compute, dist.group.WORLD, rank, rendezvous.world_size)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def send_object(groups: Groups, value: Any, timeout: timedelta) -> None:
    """Rank 0: send ``value`` (picklable) to every other rank; fail after ``timeout`` (gloo
    sends only once the receiver is waiting, so a hung rank would block rank 0 here)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    for tensor in (size, payload):
        dist.broadcast(tensor, src=0, group=groups.control, async_op=True).wait(timeout)


def receive_object(groups: Groups) -> Any:
    """Other ranks: the next value rank 0 sends (waits as long as the engine is idle)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=groups.control)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=groups.control)
    return pickle.loads(bytes(payload.untyped_storage()))
