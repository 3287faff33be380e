"""The tensor-parallel executor: rank 0 in the engine's process, one process per other rank.

The scheduler and every block table stay here, in the driver; each step rank 0 sends the
step's :class:`StepPlan` (plain data) to the other ranks over the ``control`` group, then all
ranks run the same forward pass on their shards, and rank 0 returns the gathered logits. Rank 0
runs inside the driver, as vLLM's first tensor-parallel worker long did: the plan needs no extra
hop and the logits are already where the sampler is.

Faults end in an :class:`ExecutorError` that names the rank and the cause, never in a hang: a
collective fails after ``distributed_timeout`` seconds; then the worker processes' exit codes,
the error a dying rank left in the store and the heartbeat counters say which rank is to blame.
After a failure every step and :meth:`check_health` raise (the server's ``/health`` turns 503).
Workers are daemon processes, terminated on :meth:`shutdown` and at exit; a worker whose engine
died without a word ends itself (see :mod:`pagedkv.distributed.heartbeat`).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import threading
from datetime import timedelta
from pathlib import Path

import torch

from pagedkv.attention import check_backend_reads
from pagedkv.distributed import Rendezvous, groups, heartbeat
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.executor.base import Executor, ExecutorError, KVMemory, runtime_of
from pagedkv.engine.executor.plan import StepPlan
from pagedkv.engine.executor.worker import RankSpec, build_runner, pool_blocks, run_rank
from pagedkv.models import ModelConfig
from pagedkv.models.parallel import check_divisible

#: How long shutdown waits for the workers to take the stop message.
GOODBYE_TIMEOUT = timedelta(seconds=5)


def rendezvous_of(config: EngineConfig) -> Rendezvous:
    return Rendezvous.from_options(
        config.tensor_parallel_size,
        config.distributed_timeout,
        config.nnodes,
        config.node_rank,
        config.master_addr,
        config.master_port,
    )


def rank_spec(config: EngineConfig, model_path: Path, model_config: ModelConfig) -> RankSpec:
    """What every rank builds from; the driver checks the split before starting anything."""
    check_divisible(model_config, config.tensor_parallel_size)
    rendezvous = rendezvous_of(config)
    local_ranks = len(rendezvous.spawn_ranks) + (1 if rendezvous.runs_engine else 0)
    threads = config.threads_per_rank or max(1, torch.get_num_threads() // max(1, local_ranks))
    return RankSpec(config, model_path, rendezvous, pool_blocks(config, model_config), threads)


def spawn(spec: RankSpec) -> dict[int, multiprocessing.Process]:
    """Start this machine's worker ranks as daemon processes (spawned: a fresh interpreter)."""
    context = multiprocessing.get_context("spawn")
    workers = {}
    for rank in spec.rendezvous.spawn_ranks:
        process = context.Process(
            target=run_rank, args=(spec, rank, os.getpid()), name=f"pagedkv-tp-rank{rank}", daemon=True
        )
        process.start()
        workers[rank] = process
    return workers


def stop(workers: dict[int, multiprocessing.Process], grace: float) -> None:
    """Wait ``grace`` seconds for the workers to exit, then terminate, then kill."""
    for process in workers.values():
        process.join(grace)
    for process in workers.values():
        if process.is_alive():
            process.kill()  # SIGKILL: also ends a stopped (SIGSTOP) process
            process.join(5)


def exit_cause(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path: Path, model_config: ModelConfig) -> None:
        # Before any process starts: an unknown KV dtype, or one the backend cannot read.
        check_backend_reads(config.attention_backend, config.device, config.kv_cache_dtype)
        spec = rank_spec(config, model_path, model_config)
        if not spec.rendezvous.runs_engine:
            raise ValueError("this process is not rank 0: run the worker node (pagedkv.engine.executor.node)")
        self.num_kv_blocks = spec.num_kv_blocks
        self.world_size = spec.rendezvous.world_size
        self.timeout = timedelta(seconds=spec.rendezvous.timeout)
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.workers = spawn(spec)
        atexit.register(self.shutdown)
        try:
            self.groups = groups.join(spec.rendezvous, 0, config.device.split(":")[0])
            self.store = heartbeat.connect(spec.rendezvous)
            self.runner, self.tensor_parallel = build_runner(spec, 0, self.groups)
            kv_cache = self.runner.kv_cache
            self.kv_memory = KVMemory(config.kv_cache_dtype, kv_cache.spec.bytes_per_token, kv_cache.nbytes)
            self.runtime = {**runtime_of(self.runner.model), "tensor_parallel": str(self.world_size)}
            torch.distributed.barrier(group=self.groups.control)  # every rank has loaded
        except Exception as err:
            message = self._diagnose(err, "starting")
            self.shutdown()
            raise ExecutorError(message) from err

    @property
    def collective_stats(self):
        """Rank 0's calls to and time inside the forward pass's collectives."""
        return self.tensor_parallel.stats

    def execute(self, plan: StepPlan) -> torch.Tensor:
        self.check_health()
        try:
            groups.send_object(self.groups, plan, self.timeout)
            return self.runner.execute(plan)
        except Exception as err:
            raise ExecutorError(self._fail(self._diagnose(err, "running a step"))) from err

    def check_health(self) -> None:
        if self._closed:
            raise ExecutorError("the executor was shut down")
        if self._failure is None:
            dead = [(rank, p.exitcode) for rank, p in self.workers.items() if p.exitcode is not None]
            if dead:
                rank, code = dead[0]
                self._fail(self._rank_failure(rank, code))
        if self._failure is not None:
            raise ExecutorError(self._failure)

    def _fail(self, message: str) -> str:
        with self._lock:
            self._failure = self._failure or message
            return self._failure

    def _rank_failure(self, rank: int, code: int | None) -> str:
        pid = self.workers[rank].pid if rank in self.workers else None
        said = self._reported(rank)
        where = f"tensor-parallel rank {rank}" + (f" (pid {pid})" if pid else "")
        if code is not None:
            what = exit_cause(code)
        else:
            what = "failed" if said else "stopped answering (hung, stopped or unreachable)"
        return f"{where} {what}" + (f": {said}" if said else "")

    def _reported(self, rank: int) -> str | None:
        store = getattr(self, "store", None)
        try:
            return heartbeat.reported_error(store, rank) if store is not None else None
        except Exception:
            return None

    def _diagnose(self, err: BaseException, doing: str) -> str:
        """Name the rank behind a failed collective: a worker that exited, one that reported an
        error, else one whose heartbeat stopped; else rank 0's own error."""
        for rank, process in self.workers.items():
            process.join(0.2)  # a worker that just died is reaped, one that lives is not waited for
            if process.exitcode is not None:
                return self._rank_failure(rank, process.exitcode)
        others = list(range(1, self.world_size))
        for rank in others:
            if self._reported(rank):
                return self._rank_failure(rank, None)
        store = getattr(self, "store", None)
        silent = heartbeat.silent_ranks(store, others) if store is not None else []
        if silent:
            return "; ".join(self._rank_failure(rank, None) for rank in silent) + f" (rank 0 saw: {err})"
        return f"tensor-parallel rank 0 failed while {doing}: {type(err).__name__}: {err}"

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._failure is None and hasattr(self, "runner"):
            try:  # a clean stop: every worker leaves its loop and exits 0 (a worker still inside
                # an interrupted step cannot take it: it is killed after the grace below)
                groups.send_object(self.groups, None, GOODBYE_TIMEOUT)
            except Exception:
                pass
        stop(self.workers, grace=5.0 if self._failure is None else 0.0)
        self.runner = None
        try:
            groups.leave()
        except Exception:  # a group whose peers are gone; nothing more to release
            pass
        atexit.unregister(self.shutdown)
