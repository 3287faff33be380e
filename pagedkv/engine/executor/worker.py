"""One tensor-parallel rank: its shard of the model, its share of the KV pool, its step loop.

Rank 0 builds its runner inside the engine's process (:class:`MultiprocExecutor`); every
other rank runs :func:`serve_rank` in a process of its own (spawned or started by torchrun:
through :func:`run_rank`; forked: see :mod:`~pagedkv.engine.executor.launch`): join the group,
load the shard, then run each plan rank 0 sends until it sends ``None``. A rank that fails
leaves its error in the rendezvous store for rank 0 to report, and exits.
"""

from __future__ import annotations

import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.attention import KVCache
from pagedkv.distributed import Rendezvous, groups, heartbeat
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.executor.base import TierSpec
from pagedkv.engine.executor.tier_io import RankTier
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.memory import parse_bytes
from pagedkv.models import ModelConfig, load_model
from pagedkv.models.config import resolve_dtype
from pagedkv.models.parallel import TensorParallel, shard_config


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its part (pickled into each spawned process)."""

    config: EngineConfig
    model_path: Path
    rendezvous: Rendezvous
    num_kv_blocks: int
    threads: int
    #: The second KV tier each rank holds its share of (None: none).
    tier: TierSpec | None = None


def pool_blocks(config: EngineConfig, model_config: ModelConfig) -> int:
    """Blocks of the pool: ``num_kv_blocks``, else as many as ``kv_cache_memory`` holds on each
    rank. A rank holds only its KV heads of every block (1/N of them, at least one), so the
    same memory per rank holds up to N times the blocks of one rank (vLLM sizes each worker's
    cache from that worker's memory too)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    dtype = resolve_dtype(config.dtype, default=model_config.dtype, device=config.device)
    rank_spec = shard_config(model_config, config.tensor_parallel_size).kv_spec()
    per_block = KVCache.block_bytes(rank_spec, config.block_size, dtype, config.kv_cache_dtype)
    blocks = parse_bytes(config.kv_cache_memory) // per_block
    if blocks < 1:
        budget = config.kv_cache_memory
        raise ValueError(f"a KV memory budget of {budget} per rank holds no block ({per_block} bytes each)")
    return blocks


def device_of(config: EngineConfig, rank: int) -> str:
    """CUDA: one device per rank on its machine; CPU: the CPU."""
    if not config.device.startswith("cuda"):
        return config.device
    return f"cuda:{rank % max(1, torch.cuda.device_count())}"


def build_runner(spec: RankSpec, rank: int, group: groups.Groups) -> tuple[ModelRunner, TensorParallel]:
    torch.set_num_threads(spec.threads)
    device = device_of(spec.config, rank)
    tp = TensorParallel(rank, spec.rendezvous.world_size, group.compute)
    model = load_model(
        spec.model_path,
        spec.config.dtype,
        device,
        spec.config.attention_backend,
        spec.config.linear_kernel,
        batch_hint=spec.config.max_num_batched_tokens,
        tensor_parallel=tp,
        load_format=spec.config.load_format,
    )
    dtype = model.config.dtype
    kv_cache = KVCache(
        model.config.kv_spec(),
        spec.num_kv_blocks,
        spec.config.block_size,
        dtype,
        device,
        spec.config.kv_cache_dtype,
    )
    runner = ModelRunner(model, kv_cache)
    if spec.tier is not None:
        runner.tier = RankTier(spec.tier, kv_cache, rank, spec.rendezvous.world_size)
    return runner, tp


def ignore_ctrl_c() -> None:
    """Ctrl-C reaches every process of the terminal's group: the engine stops its ranks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_rank(spec: RankSpec, rank: int, parent_pid: int | None) -> None:
    """A worker rank's whole life (the target of a spawned rank's process; ``parent_pid`` None:
    a rank torchrun started)."""
    if parent_pid is not None:
        ignore_ctrl_c()
    serve_rank(spec, rank, parent_pid)


def serve_rank(spec: RankSpec, rank: int, parent_pid: int | None) -> None:
    """Join the group, load the shard, run plans until rank 0 says stop; on failure leave the
    error in the store and raise SystemExit(1)."""
    store = heartbeat.connect(spec.rendezvous)
    heartbeat.start(store, rank, parent_pid)
    try:
        group = groups.join(spec.rendezvous, rank, spec.config.device.split(":")[0])
        runner, _ = build_runner(spec, rank, group)
        torch.distributed.barrier(group=group.control)  # loaded: rank 0 may start
        while (plan := groups.receive_object(group)) is not None:
            runner.execute(plan)
        if runner.tier is not None:
            runner.tier.close()
        groups.leave()
    except BaseException as err:
        heartbeat.report_error(store, rank, f"{type(err).__name__}: {err}")
        traceback.print_exc()
        raise SystemExit(1) from err
