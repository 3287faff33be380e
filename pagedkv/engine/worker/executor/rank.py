"""One tensor-parallel rank: its shard of the model, its share of the KV pool, its step loop.

Rank 0 builds its runner inside the engine's process (:class:`MultiprocExecutor`); every
other rank runs :func:`serve_rank` in a process of its own (spawned or started by torchrun:
through :func:`run_rank`; forked: see :mod:`~pagedkv.engine.worker.executor.launch`): join the group,
load the shard, then run each plan rank 0 sends until it sends ``None``. A rank that fails
leaves its error in the rendezvous store for rank 0 to report, and exits.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedkv.attention import KVCache, resolve_backend
from pagedkv.distributed import Rendezvous, groups, heartbeat
from pagedkv.engine.config import EngineSettings
from pagedkv.engine.worker.adapter_loads import Agree
from pagedkv.engine.worker.executor.base import TierSpec
from pagedkv.engine.worker.executor.hybrid import pool_spec
from pagedkv.engine.worker.executor.kv_budget import available_memory, size_pool
from pagedkv.engine.worker.executor.tier_io import RankTier
from pagedkv.engine.worker.lora_pages import PagedAdapterWeights, reads_pages
from pagedkv.engine.worker.model_runner import ModelRunner
from pagedkv.memory.kv_groups import KVGroups
from pagedkv.memory.pool_sizing import PoolSizing
from pagedkv.models import ModelConfig, load_model
from pagedkv.models.dtypes import resolve_dtype
from pagedkv.models.lora import LoRASlots
from pagedkv.models.lora_paged import PagedLoRA
from pagedkv.models.parallel import TensorParallel
from pagedkv.models.shard_config import shard_config
from pagedkv.models.weight_bytes import loaded_weight_bytes


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its part (pickled into each spawned process)."""

    config: EngineSettings
    model_path: Path
    rendezvous: Rendezvous
    num_kv_blocks: int
    threads: int
    #: The second KV tier each rank holds its share of (None: none).
    tier: TierSpec | None = None
    #: True when "auto" sized the pool from this machine's memory (the ranks then agree on the
    #: fewest blocks any machine found room for).
    auto_sized: bool = False
    #: The KV groups every rank's pool is paged by (hybrid paging; None: one table per sequence),
    #: and why, in words (:func:`~pagedkv.engine.worker.executor.hybrid.hybrid_kv_groups`).
    kv_groups: KVGroups | None = None
    hybrid_kv: str = "off (no sliding-window layer)"


def size_rank_pools(
    config: EngineSettings,
    model_config: ModelConfig,
    model_path: Path,
    local_ranks: int,
    kv_groups: KVGroups | None = None,
    free_memory: Callable[[str], int] = available_memory,
) -> PoolSizing:
    """Every rank's pool (all the same): ``num_kv_blocks``, else as many blocks as
    ``kv_cache_memory`` holds on each rank, else ("auto") sized from what this machine has left
    once its ``local_ranks`` ranks hold their weights. A rank holds only its KV heads of every
    block (1/N of them, at least one), so the same memory per rank holds up to N times the
    blocks of one rank (vLLM sizes each worker's cache from that worker's memory too).

    It is sized before any rank loads, so "auto" takes the memory free now (``free_memory`` of
    a device) less the weights' bytes: a rank's shard of the model at ``model_path``, quantized
    weights by their blocks' bytes (:func:`rank_weight_bytes`). On the CPU the ranks of this
    machine share the host's memory and split the share; on CUDA each rank has a device of its
    own. With ``kv_groups`` a block spans one group's layers, not every layer."""
    options = config.model
    dtype = resolve_dtype(options.dtype, default=model_config.dtype, device=options.device)
    shard = shard_config(model_config, config.parallel.tensor_parallel_size)
    block_bytes = KVCache.block_bytes(
        pool_spec(shard.kv_spec(), kv_groups), config.cache.block_size, dtype, config.cache.kv_cache_dtype
    )
    max_model_len = options.max_model_len or model_config.max_position_embeddings
    on_cuda = options.device.startswith("cuda")

    def available() -> int:
        weights = rank_weight_bytes(config, model_path, shard, dtype)
        if on_cuda:
            devices = {device_of(config, rank) for rank in range(local_ranks)}
            return max(0, min(free_memory(device) for device in devices) - weights)
        return max(0, free_memory(options.device) - local_ranks * weights)

    return size_pool(config, block_bytes, max_model_len, available, 1 if on_cuda else local_ranks, kv_groups)


def rank_weight_bytes(
    config: EngineSettings, model_path: Path, shard: ModelConfig, dtype: torch.dtype
) -> int:
    """Bytes of one rank's weights once loaded (``shard``: its part of the model at
    ``model_path``), nothing allocated: :func:`~pagedkv.models.weight_bytes.loaded_weight_bytes`,
    quantized weights kept in their blocks where the loader keeps them (on the CPU)."""
    options = config.model
    backend = resolve_backend(options.attention_backend, torch.device(options.device))
    keep = torch.device(options.device).type == "cpu"
    ranks = config.parallel.tensor_parallel_size
    return loaded_weight_bytes(model_path, shard, dtype, backend, keep, options.quantization, ranks)


def device_of(config: EngineSettings, rank: int) -> str:
    """CUDA: one device per rank on its machine; CPU: the CPU."""
    if not config.model.device.startswith("cuda"):
        return config.model.device
    return f"cuda:{rank % max(1, torch.cuda.device_count())}"


def build_runner(spec: RankSpec, rank: int, group: groups.Groups) -> tuple[ModelRunner, TensorParallel]:
    torch.set_num_threads(spec.threads)
    device = device_of(spec.config, rank)
    tp = TensorParallel(rank, spec.rendezvous.world_size, group.compute)
    model = load_model(
        spec.model_path,
        spec.config.model.dtype,
        device,
        spec.config.model.attention_backend,
        spec.config.model.linear_kernel,
        batch_hint=spec.config.scheduler.max_num_batched_tokens,
        tensor_parallel=tp,
        load_format=spec.config.model.load_format,
        quantization=spec.config.model.quantization,
        quantized_activations=spec.config.model.quantized_activations,
    )
    lora = spec.config.lora
    whole = ModelConfig.from_pretrained(spec.model_path) if lora is not None else None
    kv_spec, block_size = model.config.kv_spec(), spec.config.cache.block_size
    # the same answer on every rank: every rank's shard has the same shapes
    in_pages = lora is not None and lora.unified_paging
    in_pages = in_pages and reads_pages(model, kv_spec.num_kv_heads, kv_spec.head_dim, block_size)
    if lora is not None and not in_pages:  # adapters are read whole and cut to this rank's shard
        model.lora = LoRASlots(model, lora.max_loras, lora.max_lora_rank, checkpoint=whole)
    dtype = model.config.dtype
    kv_cache = KVCache(
        model.config.kv_spec(),
        agreed_blocks(spec, group),
        spec.config.cache.block_size,
        dtype,
        device,
        spec.config.cache.kv_cache_dtype,
        spec.kv_groups,
    )
    if in_pages:  # the rank's shard of each adapter read where it is, in the rank's KV slabs
        model.lora = PagedLoRA(model, lora.max_loras, lora.max_lora_rank, kv_cache.data, checkpoint=whole)
    runner = ModelRunner(model, kv_cache)
    if spec.tier is not None:
        runner.tier = RankTier(spec.tier, kv_cache, rank, spec.rendezvous.world_size)
    if lora is not None and lora.unified_paging:  # the rank's shard of each adapter, in its pages
        runner.adapter_pages = PagedAdapterWeights(kv_cache, model.lora)
    runner.agree = failed_on_any_rank(group.compute, device)
    return runner, tp


def failed_on_any_rank(group: Any, device: str) -> Agree:
    """How the ranks agree which of a step's adapter reads failed: a flag each, the maximum over
    the ranks, over the compute group (whose collectives time out, so a rank that died does not
    keep the others waiting)."""

    def agree(failed: list[bool]) -> list[bool]:
        flags = torch.tensor(failed, dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
        return [bool(flag) for flag in flags.tolist()]

    return agree


def agreed_blocks(spec: RankSpec, group: groups.Groups) -> int:
    """The pool's blocks on every rank: the spec's, or where "auto" sized it, the fewest any
    rank's machine found room for (each machine of a multi-node group measured its own memory;
    the driver's block tables must fit every rank's pool)."""
    if not spec.auto_sized:
        return spec.num_kv_blocks
    fewest = torch.tensor([spec.num_kv_blocks], dtype=torch.int64)
    torch.distributed.all_reduce(fewest, op=torch.distributed.ReduceOp.MIN, group=group.control)
    return int(fewest.item())


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
        group = groups.join(spec.rendezvous, rank, spec.config.model.device.split(":")[0])
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
