"""The engine's settings in typed parts, each checked once where it is made (vLLM's
``vllm/config``): :class:`ModelOptions` (the checkpoint and how it runs), :class:`CacheConfig`
(the KV pool), :class:`SchedulerConfig` (batching and admission), :class:`ParallelConfig`
(tensor-parallel ranks), :class:`TierConfig` (the second KV tier), :class:`SpeculativeConfig`
(speculative decoding), :class:`LoRAConfig` (LoRA adapters' slots). A refusal is a
``ValueError`` naming the option.

The flat options a user gives (``LLM(**kwargs)``, the command line) are
:class:`pagedkv.engine.config.EngineConfig`; its ``resolve()`` builds these parts, with the
parts that belong to the engine's own modules (request limits, structured output, the KV
policy), into one :class:`~pagedkv.engine.config.EngineSettings`. The parts (but
``SpeculativeConfig``'s optional fields, parsed from vLLM's dict) have no defaults of their
own: ``EngineConfig`` declares each option's default once.

This package sits below everything that reads it: it imports only the plain-Python memory
model and the kernels' names, never torch, so the command line reads it for free.
"""

from pagedkv.config.cache import CacheConfig
from pagedkv.config.lora import LoRAConfig
from pagedkv.config.model import ModelOptions
from pagedkv.config.parallel import ParallelConfig
from pagedkv.config.scheduler import SchedulerConfig
from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.config.tier import TierConfig

__all__ = [
    "CacheConfig",
    "LoRAConfig",
    "ModelOptions",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "TierConfig",
]
