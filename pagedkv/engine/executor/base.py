"""The seam between the engine and the model: whatever runs forward passes implements this.

The engine schedules, samples and keeps every block table; an executor owns the model and the
KV cache tensors and turns one :class:`~pagedkv.engine.plan.StepPlan` into the logits
of the rows that need them. Today one executor runs the model in the engine's own process
(:class:`~pagedkv.engine.executor.in_process.InProcessExecutor`); a tensor-parallel executor
sends the same plan to one worker process per rank and returns rank 0's gathered logits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pagedkv.engine.plan import StepPlan
from pagedkv.models import decode_stack
from pagedkv.models.config import dtype_name


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


class Executor(ABC):
    #: Physical KV blocks every rank holds (the engine's block pool has exactly these).
    num_kv_blocks: int
    #: One rank's KV cache (every rank holds one as large).
    kv_memory: KVMemory
    #: How the model runs, for logs and the CLI: dtype, linear kernel, attention backend.
    runtime: dict[str, str]

    @abstractmethod
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Copy-on-write copies, then one forward pass: float32 logits ``[plan.num_logits, vocab]``
        of the slices that need them, in plan order."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise :class:`ExecutorError` if steps can no longer run. Cheap and thread-safe: the
        server's ``/health`` calls it from its own thread while steps run."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the model, the KV cache and any worker; idempotent."""


def runtime_of(model: torch.nn.Module) -> dict[str, str]:
    """``Executor.runtime`` of a loaded model: its dtype, linear kernel, attention backend and
    what runs its decode steps' layers."""
    return {
        "dtype": dtype_name(model.config.dtype),
        "linear": model.linear_kernel.describe(),
        "attention": model.attention_backend.name,
        "decode layers": decode_stack.describe(model),
    }
