"""EngineConfig: everything that sizes an engine, declared once with its defaults, and the
typed settings it resolves to.

:class:`EngineConfig` is the user's flat options object (``LLM(**kwargs)``, the command line, the
benchmarks read their options' defaults from it). :meth:`EngineConfig.resolve` turns it into an
:class:`EngineSettings`: the typed parts of :mod:`pagedkv.config` (model, cache, scheduler,
parallel, tier) with the engine's own (speculative decoding, request limits, structured output,
the KV policy), each checked once where it is made. The engine resolves once, when it starts,
and everything inside reads the settings (``settings.cache.block_size``), never the flat fields.
A config resolves once when it is made too, so a bad option is refused before anything loads.
This module imports neither torch nor the model code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pagedkv.config import CacheConfig, ModelOptions, ParallelConfig, SchedulerConfig, TierConfig
from pagedkv.config.lora import LoRAConfig
from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.engine.core.kv_policy import KVPolicy
from pagedkv.engine.structured.config import StructuredOutputsConfig
from pagedkv.engine.validation import RequestLimits
from pagedkv.memory.kv_bytes import parse_bytes
from pagedkv.memory.pool_sizing import kv_cache_bytes

if TYPE_CHECKING:
    import torch

P = TypeVar("P")


@dataclass
class EngineConfig:
    """Everything that sizes the engine. ``model=None`` means the built-in trained tiny Llama."""

    model: str | Path | None = None
    #: The Hub revision (branch, tag or commit) of a ``model`` given as a Hub id (vLLM's
    #: ``--revision``); None: "main". See ``pagedkv/models/hub.py``.
    revision: str | None = None
    #: huggingface_hub's cache, where Hub models are found and downloaded (vLLM's
    #: ``--download-dir``); None: HF_HUB_CACHE (~/.cache/huggingface/hub).
    download_dir: str | Path | None = None
    #: The model's sampling defaults (vLLM's ``--generation-config``): "auto" reads its
    #: generation_config.json, "vllm" ignores it, a folder reads the one there
    #: (``pagedkv/models/generation_config.py``).
    generation_config: str = "auto"
    #: "auto": bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32; None: the checkpoint's
    dtype: str | torch.dtype | None = "auto"
    #: "auto" (on the CPU pagedkv's tiled GEMM where it runs the dtype, else oneDNN with packed
    #: weights where that does, else F.linear), "tiled", "onednn" or "torch" (pagedkv.kernels.LINEAR_KERNELS)
    linear_kernel: str = "auto"
    device: str = "cpu"
    #: Run without a tokenizer (vLLM's name): token-id prompts only, outputs without text. A
    #: folder without tokenizer.json runs this way on its own.
    skip_tokenizer_init: bool = False
    #: The tokenizer, when not the model's own (vLLM's ``--tokenizer``): a folder with
    #: tokenizer.json, a GGUF file, or a Hub id; None: the model's (a GGUF file's from its metadata).
    tokenizer: str | Path | None = None
    block_size: int = 16
    #: KV blocks in the pool; None: as many as ``kv_cache_memory`` holds.
    num_kv_blocks: int | None = None
    #: KV cache memory of each rank (a tensor-parallel rank holds its share of the KV heads):
    #: "2GiB", bytes, or "auto": half the memory left once the weights are loaded, at most what
    #: ``max_num_seqs`` full contexts fill, at least one (``pagedkv.memory.pool_sizing``).
    kv_cache_memory: str | int = "auto"
    #: Context length; None: the model's.
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    #: Keep every block of sliding-window layers (vLLM's flag); by default a model with windowed
    #: layers gets a block table per KV group and hands back blocks out of every window.
    disable_hybrid_kv_cache_manager: bool = False
    #: Share of the blocks kept free at admission, so running sequences can still grow.
    watermark: float = 0.01
    #: "auto" (the model's dtype), "fp8" (e4m3) or "int8": what each KV element is stored in.
    kv_cache_dtype: str = "auto"
    #: Share of each running request's remaining ``max_tokens`` that paged admission keeps room
    #: for (see ``engine/core/headroom.py``): 1.0 never over-commits when outputs run to max_tokens;
    #: 0 admits on the prompt alone and preempts when the pool runs dry.
    decode_headroom: float = 1.0
    #: vLLM's "fcfs" or "priority": with "priority", a request's ``priority`` (lower first) orders
    #: admission and preemption (see ``engine/core/fairness.py``).
    scheduling_policy: str = "fcfs"
    #: The ``priority`` values a request may carry under the ``priority`` policy (vLLM takes any
    #: integer). Order is relative, so a few levels either side of the default 0 express every
    #: tiering a client needs; a value outside is a client's mistake or an attempt to jump every
    #: queue, refused with a 400 naming the range. ``min_priority = 0`` stops any client from
    #: going ahead of default-priority requests (see ``engine/core/fairness.py``).
    min_priority: int = -100
    max_priority: int = 100
    #: Most of the running slots and KV blocks one client request may hold while others wait
    #: (see ``engine/core/fairness.py``); 1.0: no limit.
    max_running_share: float = 0.5
    #: "torch", "cpu" or "triton"; None: triton on CUDA, else cpu.
    attention_backend: str | None = None
    #: Run decode steps eagerly (vLLM's name): no CUDA graphs are captured. Graphs are a CUDA
    #: feature: on the CPU, and with tensor parallelism, every step is eager anyway.
    enforce_eager: bool = False
    #: "auto": the checkpoint's safetensors; "dummy" (vLLM's): seeded random weights made on the
    #: device from config.json alone, for benchmarks of a model's shape (pagedkv.models.dummy_weights).
    load_format: str = "auto"
    #: Quantize the decoder layers' projections of a 16/32-bit checkpoint when it loads, to one
    #: of llama.cpp's types by its name: "q8_0", "q4_0", "q4_1", "q5_0" or "q4_k"
    #: (pagedkv.models.quantization.on_the_fly); None: the checkpoint's weights as they are. A
    #: GPTQ, AWQ or compressed-tensors checkpoint loads quantized without it.
    quantization: str | None = None
    #: How products with weights kept in GGUF blocks treat the activations: "float" (as they
    #: are: the products equal the dequantized model's); "q8" (a decode step of a few rows
    #: rounds each activation row to 8-bit blocks and sums integer products, as llama.cpp
    #: does: faster, the logits move by about what llama.cpp's do; more rows stay float);
    #: "q8-all" (every product so, prefill too: llama.cpp's arithmetic throughout).
    quantized_activations: str = "float"
    #: "paged", or "contiguous" / "contiguous-oracle" to measure the reservation it replaces.
    kv_policy: str | KVPolicy = "paged"
    #: The most one request may ask for (samples, beams, tokens); an unset token budget
    #: derives from the KV pool (``RequestLimits.resolved``).
    limits: RequestLimits = field(default_factory=RequestLimits)
    #: Structured output's limits and compile threads (vLLM's ``structured_outputs_config``).
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    #: Ranks the model is sharded over (one process each; see pagedkv.models.parallel).
    tensor_parallel_size: int = 1
    #: Machines the ranks run on, this machine's index, and where they meet (node 0).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    #: Seconds a collective waits for the other ranks before the engine fails, naming them.
    distributed_timeout: float = 60.0
    #: torch CPU threads of each rank; None: the engine process's threads shared by the
    #: machine's ranks.
    threads_per_rank: int | None = None
    #: A second KV tier behind the pool (see ``engine/core/kv_tier.py``): None (off), "host" (RAM)
    #: or "disk" (files in ``kv_offload_dir``, found again by a restarted engine).
    kv_offload: str | None = None
    #: The second tier's size ("8GiB", bytes), all ranks together (each holds its share of
    #: the KV heads); required with ``kv_offload``.
    kv_offload_memory: str | int | None = None
    #: The disk tier's folder (created if missing).
    kv_offload_dir: str | Path | None = None
    #: How a preempted request leaves the pool: "swap" (its blocks go to the second tier),
    #: "recompute", or None: whichever the cost model finds cheaper, per request.
    preemption_mode: str | None = None
    #: Speculative decoding (vLLM's ``speculative_config``): a :class:`SpeculativeConfig`, or its
    #: dict or JSON text (parsed here, so a bad one is refused before anything loads); None: off.
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None
    #: Serve LoRA adapters (``LoRARequest``) beside the base model; ``max_loras`` of them
    #: resident at once, each of rank at most ``max_lora_rank`` (vLLM's defaults);
    #: ``lora_paging`` "unified" pages their weights in the KV block pool, "slots" does not.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_paging: str = "unified"

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if isinstance(spec, str):
            self.speculative_config = SpeculativeConfig.from_json(spec)
        elif isinstance(spec, Mapping):
            self.speculative_config = SpeculativeConfig.from_dict(spec)
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a dict or JSON text, got {type(spec).__name__}")
        self.resolve()  # every option checked now: a bad one is refused before anything loads

    def resolve(self) -> EngineSettings:
        """These options as typed parts, each checked where it is made (a ``ValueError`` naming
        the option otherwise). A part's field holds the option of its name, but for the sizes
        given as text ("256MiB", "auto"), held in bytes, and the tier's fields."""
        spec = self.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # parsed by __post_init__
        tier_bytes = None if self.kv_offload_memory is None else parse_bytes(self.kv_offload_memory)
        return EngineSettings(
            model=self._part(ModelOptions),
            cache=self._part(CacheConfig, pool_bytes=kv_cache_bytes(self.kv_cache_memory)),
            scheduler=self._part(SchedulerConfig),
            parallel=self._part(ParallelConfig),
            tier=self._part(
                TierConfig,
                kind=self.kv_offload,
                capacity_bytes=tier_bytes,
                folder=None if self.kv_offload_dir is None else Path(self.kv_offload_dir),
            ),
            speculative=spec,
            lora=self._part(LoRAConfig) if self.enable_lora else None,
            kv_policy=KVPolicy.named(self.kv_policy),
            limits=self.limits,
            structured_outputs=self.structured_outputs_config,
        )

    def _part(self, part: type[P], **converted: Any) -> P:
        """``part`` (a dataclass) of the options named like its fields, and of ``converted``."""
        fields = dataclasses.fields(part)  # type: ignore[arg-type]
        return part(
            **{f.name: converted[f.name] if f.name in converted else getattr(self, f.name) for f in fields}
        )


@dataclass(frozen=True)
class EngineSettings:
    """An engine's settings in typed parts (vLLM's ``VllmConfig``), made by
    :meth:`EngineConfig.resolve`: the one place each value is read from once the engine starts,
    and what the executor ships to tensor-parallel ranks. Checks that span two parts are made
    here."""

    model: ModelOptions
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    tier: TierConfig
    #: Speculative decoding; None: off.
    speculative: SpeculativeConfig | None
    #: LoRA adapters' slots and rank limit; None: no adapters (``enable_lora`` off).
    lora: LoRAConfig | None
    #: How admission reserves KV blocks: paged, or a contiguous reservation.
    kv_policy: KVPolicy
    #: The most one request may ask for; an unset token budget derives from the KV pool.
    limits: RequestLimits
    structured_outputs: StructuredOutputsConfig

    def __post_init__(self) -> None:
        if self.tier.kind == "disk" and self.parallel.tensor_parallel_size > 1:
            raise ValueError(
                "the disk KV tier runs on one rank; with --tensor-parallel-size > 1 use the host tier "
                "(--kv-offloading-size without --kv-offload-dir)"
            )

    @property
    def prefix_caching(self) -> bool:
        """Full blocks are shared by prefix: asked for, and the KV policy shares blocks."""
        return self.cache.enable_prefix_caching and self.kv_policy.allows_prefix_caching
