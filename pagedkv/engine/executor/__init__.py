"""The seam between the engine and the model: a step's plan in, the sampled rows' logits out."""

from pagedkv.engine.executor.base import Executor, ExecutorError
from pagedkv.engine.executor.in_process import InProcessExecutor
from pagedkv.engine.executor.plan import SeqSlice, StepPlan

__all__ = ["Executor", "ExecutorError", "InProcessExecutor", "SeqSlice", "StepPlan"]
