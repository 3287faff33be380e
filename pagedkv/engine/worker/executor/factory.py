"""Which executor an engine gets: in-process for one rank, multi-process for tensor parallelism."""

from __future__ import annotations

from pathlib import Path

from pagedkv.engine.config import EngineSettings
from pagedkv.engine.worker.executor.base import Executor
from pagedkv.engine.worker.executor.in_process import InProcessExecutor
from pagedkv.models import ModelConfig


def make_executor(config: EngineSettings, model_path: Path, model_config: ModelConfig) -> Executor:
    if config.parallel.tensor_parallel_size == 1:
        return InProcessExecutor(config, model_path, model_config)
    from pagedkv.engine.worker.executor.multiproc import (
        MultiprocExecutor,  # torch.distributed only when asked
    )

    return MultiprocExecutor(config, model_path, model_config)
