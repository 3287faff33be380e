"""The tensor-parallel executor: rank 0 in the engine's process, one process per other rank.

The scheduler and every block table stay here, in the driver; each step rank 0 sends the
step's :class:`StepPlan` (plain data) to the other ranks over the ``control`` group, then all
ranks run the same forward pass on their shards, and rank 0 returns the gathered logits. A plan
carries block-table edits, not tables: every rank applies the same edits to the tables its
runner keeps, so the ranks' tables stay equal. No rank can miss a plan: every rank has joined
and loaded (the barrier at start-up) before the first, which resets the tables, and a rank that
fails ends the executor. Rank 0
runs inside the driver, as vLLM's first tensor-parallel worker long did: the plan needs no extra
hop and the logits are already where the sampler is.

Start-up is watched (:mod:`~pagedkv.engine.worker.executor.launch`): rank 0 joins the group only once
every rank has started, and a rank that exits before that ends start-up at once with its exit
status. Faults end in an :class:`ExecutorError` that names the rank and the cause, never in a
hang: a collective fails after ``distributed_timeout`` seconds; then the worker processes' exit
codes, the error a dying rank left in the store and the heartbeat counters say which rank is to
blame. After a failure -- of a worker or of rank 0's own part of the step -- the workers are
stopped, and every step and :meth:`check_health` raise (the server's ``/health`` turns 503).

The workers and the process group are released by :meth:`shutdown`, or when the executor is
garbage-collected, or at exit (a ``weakref.finalize`` that holds the ranks, not the executor),
so another tensor-parallel engine can start in the same process. A worker whose engine died
without a word ends itself (see :mod:`pagedkv.distributed.heartbeat`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from datetime import timedelta
from pathlib import Path

import torch

from pagedkv.attention import check_backend_reads
from pagedkv.distributed import Rendezvous, groups, heartbeat
from pagedkv.engine.config import EngineSettings
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.cuda_graphs import eager_reason
from pagedkv.engine.worker.executor import launch
from pagedkv.engine.worker.executor.base import Executor, ExecutorError, KVMemory, runtime_of
from pagedkv.engine.worker.executor.hybrid import engine_kv_groups
from pagedkv.engine.worker.executor.rank import RankSpec, build_runner, size_rank_pools
from pagedkv.engine.worker.executor.tier_io import plan_tier
from pagedkv.memory.pool_sizing import AUTO, PoolSizing
from pagedkv.models import ModelConfig
from pagedkv.models.parallel import check_divisible

#: How long shutdown waits for the workers to take the stop message.
GOODBYE_TIMEOUT = timedelta(seconds=5)


def rendezvous_of(config: EngineSettings) -> Rendezvous:
    return Rendezvous.from_options(config.parallel)


def rank_spec(
    config: EngineSettings, model_path: Path, model_config: ModelConfig
) -> tuple[RankSpec, PoolSizing]:
    """What every rank builds from, and how its pool was sized; the driver checks the split
    before starting anything."""
    check_divisible(model_config, config.parallel.tensor_parallel_size)
    rendezvous = rendezvous_of(config)
    local_ranks = len(rendezvous.spawn_ranks) + (1 if rendezvous.runs_engine else 0)
    threads = config.parallel.threads_per_rank or max(1, torch.get_num_threads() // max(1, local_ranks))
    tier = plan_tier(config, model_path, model_config)
    kv_groups, hybrid = engine_kv_groups(config, model_config)  # world size == tensor parallel size
    # the ranks of this machine share its memory; torchrun starts each in a process of its own
    machine_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if rendezvous.external else local_ranks
    sizing = size_rank_pools(config, model_config, model_path, max(1, machine_ranks), kv_groups)
    auto = sizing.source == AUTO
    spec = RankSpec(config, model_path, rendezvous, sizing.num_blocks, threads, tier, auto, kv_groups, hybrid)
    return spec, sizing


class Ranks:
    """What the executor must give back: the worker processes, the store and the process group.

    Kept apart from the executor so that the finalizer releasing them holds no reference to
    it. ``failure`` (the first fault, once there is one) is set at most once.
    """

    def __init__(self, workers: dict) -> None:
        self.workers = workers
        self.store = None
        self.groups: groups.Groups | None = None
        self.failure: str | None = None
        self.lock = threading.Lock()
        self._owner = os.getpid()

    def fail(self, message: str) -> str:
        with self.lock:
            self.failure = self.failure or message
            return self.failure

    def release(self) -> None:
        """Stop the workers (a goodbye first when healthy) and leave the group."""
        if os.getpid() != self._owner:  # a forked copy of the engine's process: not its ranks
            return
        if self.failure is None and self.groups is not None:
            try:  # a clean stop: every worker leaves its loop and exits 0 (a worker still inside
                # an interrupted step cannot take it: it is killed after the grace below)
                groups.send_object(self.groups, None, GOODBYE_TIMEOUT)
            except Exception:
                pass
        launch.stop(self.workers, grace=5.0 if self.failure is None else 0.0)
        self.groups = self.store = None
        try:
            groups.leave()
        except Exception:  # a group whose peers are gone; nothing more to release
            pass


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineSettings, model_path: Path, model_config: ModelConfig) -> None:
        launch.refuse_to_start_while_bootstrapping()
        # Before any process starts: a KV dtype the device's backend cannot read.
        check_backend_reads(config.model.attention_backend, config.model.device, config.cache.kv_cache_dtype)
        spec, self.kv_sizing = rank_spec(config, model_path, model_config)
        if not spec.rendezvous.runs_engine:
            raise ValueError(
                "this process is not rank 0: run the worker node (pagedkv.engine.worker.executor.node)"
            )
        self.num_kv_blocks = spec.num_kv_blocks
        self.tier, self.kv_groups = spec.tier, spec.kv_groups
        self.world_size = spec.rendezvous.world_size
        self.timeout = timedelta(seconds=spec.rendezvous.timeout)
        #: How this machine's worker ranks were started: "fork" or "spawn".
        self.start_method = launch.start_method(config.model.device)
        self.ranks = Ranks(launch.start_ranks(spec, self.start_method))
        self._release = weakref.finalize(self, self.ranks.release)
        try:
            self._start(spec, config.model.device.split(":")[0])
        except Exception as err:
            message = self.ranks.fail(self._diagnose(err, "starting"))
            self.shutdown()  # failed: the workers are killed, not waited for
            raise ExecutorError(message) from err

    def _start(self, spec: RankSpec, device: str) -> None:
        """Host the store; watching the workers, wait until every rank has started and then
        until the group is formed; load rank 0's shard; the barrier: every rank has loaded."""
        store = self.ranks.store = groups.store(spec.rendezvous, 0)
        others = list(range(1, self.world_size))
        timeout = groups.STARTUP_TIMEOUT.total_seconds()
        exited = launch.first_exit(self.workers, lambda: heartbeat.started(store, others), timeout)
        if exited is None:  # a rank that dies while the group forms would keep join waiting
            joined = launch.in_background(lambda: groups.join(spec.rendezvous, 0, device, store))
            exited = launch.first_exit(self.workers, joined.done, None)
        if exited is not None:
            raise ExecutorError(self._rank_failure(exited, self.workers[exited].exitcode))
        self.ranks.groups = joined.result()
        self.runner, self.tensor_parallel = build_runner(spec, 0, self.ranks.groups)
        kv_cache = self.runner.kv_cache
        # "auto" on several machines: every rank holds the fewest blocks any machine had room for
        self.num_kv_blocks = kv_cache.num_blocks
        self.kv_sizing = dataclasses.replace(self.kv_sizing, num_blocks=kv_cache.num_blocks)
        self.kv_memory = KVMemory(
            spec.config.cache.kv_cache_dtype, kv_cache.spec.bytes_per_token, kv_cache.nbytes, self.world_size
        )
        self.runtime = {
            **runtime_of(self.runner.model),
            "tensor_parallel": str(self.world_size),
            "cuda graphs": eager_reason(
                spec.config.model.device, spec.config.model.enforce_eager, self.world_size
            ),
            "kv cache": f"{kv_cache.nbytes / 2**20:.1f} MiB per rank ({kv_cache.num_blocks} blocks)",
            "hybrid kv": spec.hybrid_kv,
        }
        torch.distributed.barrier(group=self.ranks.groups.control)

    @property
    def workers(self) -> dict:
        """This machine's worker ranks' processes, by rank."""
        return self.ranks.workers

    @property
    def collective_stats(self):
        """Rank 0's calls to and time inside the forward pass's collectives."""
        return self.tensor_parallel.stats

    def execute(self, plan: StepPlan) -> torch.Tensor:
        self.check_health()
        try:
            groups.send_object(self.ranks.groups, plan, self.timeout)
            return self.runner.execute(plan)
        except Exception as err:
            message = self.ranks.fail(self._diagnose(err, "running a step"))
            # The ranks are out of step (some may wait inside a collective rank 0 left): none
            # can run another step, so none is kept waiting for its timeout.
            launch.stop(self.workers, grace=0.0)
            raise ExecutorError(message) from err

    def check_health(self) -> None:
        if not self._release.alive:
            raise ExecutorError("the executor was shut down")
        if self.ranks.failure is None:
            dead = [(rank, p.exitcode) for rank, p in self.workers.items() if p.exitcode is not None]
            if dead:
                rank, code = dead[0]
                self.ranks.fail(self._rank_failure(rank, code))
        if self.ranks.failure is not None:
            raise ExecutorError(self.ranks.failure)

    def _rank_failure(self, rank: int, code: int | None) -> str:
        pid = self.workers[rank].pid if rank in self.workers else None
        said = self._reported(rank)
        where = f"tensor-parallel rank {rank}" + (f" (pid {pid})" if pid else "")
        if code is not None:
            what = launch.exit_cause(code)
        else:
            what = "failed" if said else "stopped answering (hung, stopped or unreachable)"
        return f"{where} {what}" + (f": {said}" if said else "")

    def _reported(self, rank: int) -> str | None:
        store = self.ranks.store
        try:
            return heartbeat.reported_error(store, rank) if store is not None else None
        except Exception:
            return None

    def _diagnose(self, err: BaseException, doing: str) -> str:
        """Name the rank behind a failed collective: a worker that exited, one that reported an
        error, else one whose heartbeat stopped; else rank 0's own error."""
        if isinstance(err, ExecutorError):  # already says which rank and why
            return str(err)
        for rank, process in self.workers.items():
            process.join(0.2)  # a worker that just died is reaped, one that lives is not waited for
            if process.exitcode is not None:
                return self._rank_failure(rank, process.exitcode)
        others = list(range(1, self.world_size))
        for rank in others:
            if self._reported(rank):
                return self._rank_failure(rank, None)
        store = self.ranks.store
        silent = heartbeat.silent_ranks(store, others) if store is not None else []
        if silent:
            return "; ".join(self._rank_failure(rank, None) for rank in silent) + f" (rank 0 saw: {err})"
        return f"tensor-parallel rank 0 failed while {doing}: {type(err).__name__}: {err}"

    def shutdown(self) -> None:
        """Release the workers and the process group (at once; idempotent), then rank 0's model."""
        self._release()
        runner = getattr(self, "runner", None)
        if runner is not None and runner.tier is not None:
            runner.tier.close()
        self.runner = None
