"""A machine (or a torchrun process) that holds ranks but not the engine.

With ``--nnodes M --node-rank K`` (K > 0) the command only starts this machine's ranks and
waits for them; under torchrun a process whose ``RANK`` is not 0 is itself that rank. Either
way the process serves nothing: rank 0's machine runs the engine, the scheduler and the server.
"""

from __future__ import annotations

import multiprocessing.connection

from pagedkv.engine.config import EngineSettings
from pagedkv.engine.worker.executor.launch import exit_cause, start_method, start_ranks, stop
from pagedkv.engine.worker.executor.multiproc import rank_spec, rendezvous_of
from pagedkv.engine.worker.executor.rank import run_rank
from pagedkv.models import ModelConfig
from pagedkv.models.hub import resolve_model


def is_worker_node(config: EngineSettings) -> bool:
    """True when this process holds ranks other than 0 and must not build an engine."""
    return config.parallel.tensor_parallel_size > 1 and not rendezvous_of(config).runs_engine


def run_worker_node(config: EngineSettings) -> int:
    """Run this machine's ranks until rank 0 stops them; the exit status of the first failure."""
    options = config.model
    path = resolve_model(options.model, options.revision, options.download_dir, options.loads_weights).folder
    spec, _ = rank_spec(config, path, ModelConfig.from_pretrained(path))
    if spec.rendezvous.external:
        run_rank(spec, spec.rendezvous.rank, None)
        return 0
    workers = start_ranks(spec, start_method(options.device))
    try:
        pending = dict(workers)
        while pending:
            ready = multiprocessing.connection.wait([p.sentinel for p in pending.values()])
            for rank, process in list(pending.items()):
                if process.sentinel in ready:
                    process.join()
                    del pending[rank]
                    if process.exitcode != 0:
                        print(f"pagedkv: rank {rank} {exit_cause(process.exitcode)}")
                        return 1
        return 0
    finally:
        stop(workers, grace=0.0)
