"""The seam between the engine and the model: a step's plan in, the sampled rows' logits out."""

from pagedkv.engine.executor.base import Executor, ExecutorError, KVMemory
from pagedkv.engine.executor.in_process import InProcessExecutor
from pagedkv.engine.executor.plan import SeqSlice, StepPlan

__all__ = ["Executor", "ExecutorError", "InProcessExecutor", "KVMemory", "SeqSlice", "StepPlan"]
