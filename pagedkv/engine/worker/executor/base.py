"""The seam between the engine and the model: whatever runs forward passes implements this.

The engine schedules, samples and keeps every block table; an executor owns the model and the
KV cache tensors and turns one :class:`~pagedkv.engine.core.plan.StepPlan` into the logits
of the rows that need them. Today one executor runs the model in the engine's own process
(:class:`~pagedkv.engine.worker.executor.in_process.InProcessExecutor`); a tensor-parallel executor
sends the same plan to one worker process per rank and returns rank 0's gathered logits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pagedkv.engine.core.plan import StepPlan
from pagedkv.memory import TransferReport
from pagedkv.memory.kv_groups import KVGroups
from pagedkv.memory.pool_sizing import PoolSizing
from pagedkv.models import decode_stack
from pagedkv.models.dtypes import dtype_name


class ExecutorError(RuntimeError):
    """The executor can no longer run steps (shut down, or a worker failed); says why."""


@dataclass(frozen=True)
class KVMemory:
    """What the KV cache costs on each rank: its element type, bytes per token (scales
    included) and in all; ``ranks`` hold one such cache each (their shares of the KV heads)."""

    kv_cache_dtype: str
    bytes_per_token: int
    total_bytes: int
    ranks: int = 1

    def stats(self) -> dict[str, int | str]:
        """The figures ``kv_stats()`` reports: ``bytes_per_token`` and ``kv_cache_bytes`` are
        one rank's, ``tensor_parallel_size`` ranks hold as much each."""
        return {
            "kv_cache_dtype": self.kv_cache_dtype,
            "bytes_per_token": self.bytes_per_token,
            "kv_cache_bytes": self.total_bytes,
            "tensor_parallel_size": self.ranks,
        }


@dataclass(frozen=True)
class TierSpec:
    """What every rank builds its tier from (plain data: pickled to tensor-parallel ranks).
    ``capacity`` blocks, each ``block_bytes`` for the whole model (a rank holds its share of
    the KV heads of each); ``model``: the weights' fingerprint a disk file's header names."""

    kind: str
    capacity: int
    block_bytes: int
    folder: str | None = None
    model: str = ""

    @property
    def medium(self) -> str:
        """vLLM's KV-event medium: "CPU" for host RAM, "DISK" for files."""
        return "DISK" if self.kind == "disk" else "CPU"

    @property
    def transfer_types(self) -> tuple[str, str]:
        """vLLM's ``transfer_type`` labels, out of the pool and into it."""
        return f"GPU_to_{self.medium}", f"{self.medium}_to_GPU"


class Executor(ABC):
    #: Physical KV blocks every rank holds (the engine's block pool has exactly these).
    num_kv_blocks: int
    #: One rank's KV cache (every rank holds one as large).
    kv_memory: KVMemory
    #: How the pool was sized at start-up (its ``describe()`` is the start-up line).
    kv_sizing: PoolSizing
    #: How the model runs, for logs and the CLI: dtype, linear kernel, attention backend.
    runtime: dict[str, str]
    #: The second KV tier every rank holds its share of (None: no tier).
    tier: TierSpec | None = None
    #: The KV groups the pool is paged by (hybrid paging; None: one table per sequence).
    kv_groups: KVGroups | None = None

    @abstractmethod
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """The plan's tier moves and copy-on-write copies, then one forward pass: float32 logits
        ``[plan.num_logits, vocab]`` of the slices that need them, in plan order (none for a
        plan without slices, which only moves blocks)."""

    # -- the second KV tier (every rank moves the same blocks; rank 0's account stands for all)
    def tier_report(self) -> TransferReport:
        """The tier moves that ended since the last call (see :class:`TransferReport`)."""
        tier = self._rank_tier()
        return TransferReport() if tier is None else tier.report()

    def tier_blocks_found(self) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """The blocks a disk tier found at start-up, oldest first: (hash, parent, token ids)."""
        tier = self._rank_tier()
        return [] if tier is None else tier.found()

    def discard_tier_blocks(self, hashes: list[int]) -> None:
        """Delete what a disk tier holds of these blocks (found but not indexed)."""
        tier = self._rank_tier()
        if tier is not None:
            tier.discard(hashes)

    def drain_tier(self) -> None:
        """Wait until a disk tier's queued writes have ended."""
        tier = self._rank_tier()
        if tier is not None:
            tier.drain()

    def _rank_tier(self):
        """Rank 0's tier: the runner in this process holds it (none before start-up ends or
        after shutdown)."""
        runner = getattr(self, "runner", None)
        return None if runner is None else runner.tier

    def adapter_failures(self) -> dict[int, str]:
        """The LoRA adapters the last step could not load, by id, with why: every rank skipped
        them alike and their rows' outputs are not to be used (rank 0's runner holds the agreed
        set)."""
        runner = getattr(self, "runner", None)
        return {} if runner is None else runner.adapter_failures

    @abstractmethod
    def check_health(self) -> None:
        """Raise :class:`ExecutorError` if steps can no longer run. Cheap and thread-safe: the
        server's ``/health`` calls it from its own thread while steps run."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the model, the KV cache and any worker; idempotent."""


def runtime_of(model: torch.nn.Module) -> dict[str, str]:
    """``Executor.runtime`` of a loaded model: its dtype (and quantization, if the loader
    quantized it), linear kernel, attention backend and what runs its decode steps' layers."""
    quantized = {} if model.quantization is None else {"weights": model.quantization}
    if model.quantized_products is not None:
        quantized["quantized products"] = model.quantized_products
    return {
        "dtype": dtype_name(model.config.dtype),
        **quantized,
        "linear": model.linear_kernel.describe(),
        "attention": model.attention_backend.name,
        "decode layers": decode_stack.describe(model),
    }
