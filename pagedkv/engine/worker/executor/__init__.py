"""The seam between the engine and the model: a step's plan (:mod:`pagedkv.engine.core.plan`) in, the
sampled rows' logits out.

The executors themselves (``in_process``, ``multiproc``) are imported from their modules (or made
by ``factory``): an executor here would import the model runner while this package is still half
initialized.
"""

from pagedkv.engine.worker.executor.base import Executor, ExecutorError, KVMemory

__all__ = ["Executor", "ExecutorError", "KVMemory"]
