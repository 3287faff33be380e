"""The seam between the engine and the model: a step's plan in, the sampled rows' logits out.

The executors themselves (``in_process``, ``multiproc``) are imported from their modules (or made
by ``factory``): the model runner reads ``plan``, and an executor here would import the runner
back while this package is still half initialized.
"""

from pagedkv.engine.executor.base import Executor, ExecutorError, KVMemory
from pagedkv.engine.executor.plan import SeqSlice, StepPlan

__all__ = ["Executor", "ExecutorError", "KVMemory", "SeqSlice", "StepPlan"]
