"""The parallel part of the engine's settings: how many ranks the model is sharded over, the
machines they run on and where they meet (vLLM's ``ParallelConfig``; the launch itself is
:mod:`pagedkv.distributed.rendezvous`). Data-parallel replicas are the server's concern
(``pagedkv.server.replicas``): each replica is an engine of its own."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.config.checks import optional_positive_int, positive_int


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism's ranks and rendezvous, checked when made (the model's own split --
    its heads over the ranks -- is checked once the model's config is read)."""

    tensor_parallel_size: int
    #: The machines, ``tensor_parallel_size / nnodes`` ranks each; machine 0 runs the engine.
    nnodes: int
    node_rank: int
    #: Machine 0's address, required over several machines; None: 127.0.0.1 on one.
    master_addr: str | None
    #: None: a free port on one machine, torchrun's 29500 over several.
    master_port: int | None
    #: Seconds before a collective that waits on a rank fails.
    distributed_timeout: float
    #: None: the engine process's threads, shared by the machine's ranks.
    threads_per_rank: int | None

    def __post_init__(self) -> None:
        world_size = positive_int("tensor_parallel_size", self.tensor_parallel_size)
        nnodes = positive_int("nnodes", self.nnodes)
        if world_size % nnodes:
            raise ValueError(f"tensor_parallel_size {world_size} cannot be split over {nnodes} nodes")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be in 0 .. {nnodes - 1}, got {self.node_rank}")
        if nnodes > 1 and self.master_addr is None:
            raise ValueError("--master-addr is required with --nnodes > 1 (the address of node 0)")
        optional_positive_int("master_port", self.master_port)
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout}")
        optional_positive_int("threads_per_rank", self.threads_per_rank)

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes
