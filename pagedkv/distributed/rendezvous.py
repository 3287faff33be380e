"""Where the ranks of a tensor-parallel group meet and which of them this machine starts.

Three launches, one record:

* one machine (the default): the engine's process is rank 0 and starts ranks ``1 .. N-1``;
  they meet on a free port of ``127.0.0.1``;
* several machines with pagedkv's own options (vLLM's names): every machine runs the same
  command with ``--nnodes M --node-rank K --master-addr HOST --master-port PORT``; machine 0
  runs the engine as rank 0 and starts ranks ``1 .. N/M - 1``, machine ``K`` starts ranks
  ``K*N/M .. (K+1)*N/M - 1`` and serves nothing;
* torchrun (``torchrun --nnodes M --nproc-per-node N/M ... -m pagedkv serve ...``): torchrun
  started every rank; ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` say which this is
  and pagedkv starts nothing.

No torch here: the command line builds this before deciding whether to load anything.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.config.parallel import ParallelConfig

#: torchrun's default rendezvous port, used when several machines give no --master-port.
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Rendezvous:
    world_size: int
    master_addr: str
    master_port: int
    #: seconds a collective may wait for the other ranks before it fails
    timeout: float
    #: the rank this process is: 0 runs the engine; torchrun's RANK; None: this process only
    #: starts the ranks of another machine
    rank: int | None
    #: ranks this process starts as child processes
    spawn_ranks: tuple[int, ...]
    #: True when torchrun started every rank (join with env://, start nothing)
    external: bool = False

    @property
    def init_method(self) -> str:
        return "env://" if self.external else f"tcp://{self.master_addr}:{self.master_port}"

    @classmethod
    def from_options(cls, parallel: ParallelConfig, environ: Mapping[str, str] | None = None) -> Rendezvous:
        """The launch of ``parallel``'s ranks (its options checked when it was made); torchrun's
        environment, when present, wins."""
        env = os.environ if environ is None else environ
        world_size, timeout = parallel.tensor_parallel_size, parallel.distributed_timeout
        nnodes, node_rank = parallel.nnodes, parallel.node_rank
        master_addr, master_port = parallel.master_addr, parallel.master_port
        if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
            if int(env["WORLD_SIZE"]) != world_size:
                raise ValueError(
                    f"torchrun started {env['WORLD_SIZE']} processes but tensor_parallel_size is "
                    f"{world_size}: run one process per rank"
                )
            addr, port = env["MASTER_ADDR"], int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT))
            return cls(world_size, addr, port, timeout, int(env["RANK"]), (), external=True)
        per_node = parallel.ranks_per_node
        first = node_rank * per_node
        local = tuple(r for r in range(first, first + per_node) if r != 0)
        if nnodes == 1:
            addr = master_addr or "127.0.0.1"
            port = master_port or free_port(addr)
        else:
            assert master_addr is not None  # ParallelConfig requires it with nnodes > 1
            addr, port = master_addr, master_port or DEFAULT_MASTER_PORT
        return cls(world_size, addr, port, timeout, 0 if node_rank == 0 else None, local)

    @property
    def runs_engine(self) -> bool:
        """This process is rank 0: it runs the engine (scheduler, sampler, server)."""
        return self.rank == 0


def free_port(addr: str) -> int:
    with socket.socket() as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]
