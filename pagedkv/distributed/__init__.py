"""torch.distributed set-up for tensor parallelism: where the ranks meet, their process groups,
and how a rank that stopped answering is told apart from one that is only waiting.

:mod:`~pagedkv.distributed.rendezvous` reads the launch (one machine, ``--nnodes`` options or
torchrun's environment) without importing torch; :mod:`~pagedkv.distributed.groups` joins the
process group (gloo on CPU, NCCL on CUDA) with collective timeouts;
:mod:`~pagedkv.distributed.heartbeat` keeps a per-rank counter in the rendezvous store.
"""

from pagedkv.distributed.rendezvous import Rendezvous

__all__ = ["Rendezvous"]
