"""Every engine option the command line declares, once: its flag, help text, argument type and
the ``EngineConfig`` field it sets, with the default read from that field (the request limits'
from :class:`~pagedkv.engine.validation.RequestLimits`, the structured output settings' from
:class:`~pagedkv.engine.structured.config.StructuredOutputsConfig`). How a command adds them and
reads them back is :mod:`pagedkv.cli_args`.

Nothing here imports torch or FastAPI, so building the parser (and ``pagedkv --help``) stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedkv.cli_parsing import (
    kv_memory_size,
    offload_size,
    positive_float,
    positive_int,
    share_fraction,
    speculative_config,
    unit_fraction,
)
from pagedkv.config.model import DTYPE_NAMES, LOAD_FORMATS, QUANTIZATION_NAMES
from pagedkv.config.scheduler import SCHEDULING_POLICIES
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.core.kv_policy import POLICY_NAMES
from pagedkv.engine.structured.config import StructuredOutputsConfig
from pagedkv.engine.validation import RequestLimits
from pagedkv.kernels import LINEAR_KERNELS, QUANTIZED_ACTIVATIONS
from pagedkv.memory.kv_bytes import KV_CACHE_DTYPE_NAMES

ENGINE_GROUP = "engine"
LIMITS_GROUP = "request limits (over a limit: refused, naming it)"
STRUCTURED_GROUP = "structured output (JSON schema, regex, choice, grammar; tool calls)"
#: The flag and destination prefix of StructuredOutputsConfig's fields (vLLM's config name).
STRUCTURED_PREFIX = "structured_outputs_"


@dataclass(frozen=True)
class EngineOption:
    """One engine option: the EngineConfig field it sets (``--the-field-name`` unless ``flag``
    says otherwise) and how argparse reads it. A request limit sets the field of
    ``EngineConfig.limits`` (a :class:`RequestLimits`) instead; a structured output option the
    field of ``EngineConfig.structured_outputs_config`` (``--structured-outputs-the-field``)."""

    field: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    flag: str | None = None
    #: "store_false" for a switch that turns a default-on field off
    action: str | None = None
    is_limit: bool = False
    is_structured: bool = False

    @property
    def default(self) -> Any:
        owner = (
            RequestLimits
            if self.is_limit
            else StructuredOutputsConfig
            if self.is_structured
            else EngineConfig
        )
        return getattr(owner, self.field)

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments."""
        return STRUCTURED_PREFIX + self.field if self.is_structured else self.field

    def add_to(self, group: argparse._ArgumentGroup, default: Any) -> None:
        flag = self.flag or "--" + self.dest.replace("_", "-")
        keywords = {"action": self.action} if self.action else {"type": self.type, "choices": self.choices}
        group.add_argument(flag, dest=self.dest, default=default, help=self.help, **keywords)


DEFAULT = "(default: %(default)s)"
#: Every engine option; defaults come from EngineConfig.
ENGINE_OPTIONS = (
    EngineOption(
        "model",
        "Hugging Face model folder, a GGUF file (or a folder holding one; a split model by any of its "
        "parts), or a Hub id org/name (found in the Hugging Face cache, downloaded if missing; "
        "HF_HUB_OFFLINE=1 only reads the cache) (default: the built-in tiny Llama trained on the Python "
        "standard library)",
    ),
    EngineOption("revision", "branch, tag or commit of a --model given as a Hub id (default: main)"),
    EngineOption(
        "download_dir",
        "the Hugging Face cache that Hub models are read from and downloaded to (default: $HF_HUB_CACHE)",
    ),
    EngineOption(
        "generation_config",
        "the model's default sampling parameters, for the fields a request leaves unset: auto (the "
        "sampling fields of the model's generation_config.json), vllm (ignore them), or a folder "
        f"holding a generation_config.json {DEFAULT}",
    ),
    EngineOption(
        "dtype",
        f"auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32 {DEFAULT}",
        choices=DTYPE_NAMES,
    ),
    EngineOption("device", f"torch device {DEFAULT}"),
    EngineOption(
        "tokenizer",
        "the tokenizer, when not the model's own: a folder with tokenizer.json, a GGUF file, or a Hub id "
        "(default: the model's; a GGUF file's from its metadata)",
    ),
    EngineOption(
        "skip_tokenizer_init",
        "run without a tokenizer: token-id prompts only, outputs without text",
        action="store_true",
    ),
    EngineOption(
        "linear_kernel",
        f"GEMM kernel of the linear layers: auto (on the CPU pagedkv's tiled GEMM where it runs the dtype, "
        f"else oneDNN with packed weights, else F.linear), tiled, onednn or torch (F.linear) {DEFAULT}",
        choices=LINEAR_KERNELS,
    ),
    EngineOption("block_size", f"tokens per KV block {DEFAULT}", positive_int),
    EngineOption("num_kv_blocks", "KV blocks in the pool (default: from --kv-cache-memory)", positive_int),
    EngineOption(
        "kv_cache_memory",
        "KV cache memory per rank, unless --num-kv-blocks: a size (2GiB, 512MB, bytes) or auto: half the "
        "memory free once the weights are loaded (MemAvailable, or the CUDA device's), at most what "
        "--max-num-seqs full --max-model-len contexts fill, at least one such context; the ranks of one "
        f"CPU machine split it {DEFAULT}",
        kv_memory_size,
    ),
    EngineOption("max_model_len", "context length (default: the model's)", positive_int),
    EngineOption("max_num_seqs", f"most sequences per step {DEFAULT}", positive_int),
    EngineOption("max_num_batched_tokens", f"most tokens per step {DEFAULT}", positive_int),
    EngineOption(
        "enable_prefix_caching", "turn prefix caching off", flag="--no-prefix-caching", action="store_false"
    ),
    EngineOption(
        "disable_hybrid_kv_cache_manager",
        "keep every block of sliding-window layers (default: a model with windowed layers pages them by "
        "KV group, handing back the blocks out of every window)",
        action="store_true",
    ),
    EngineOption(
        "kv_cache_dtype",
        f"KV element type: auto (the model's dtype), fp8 (e4m3) or int8, with a float32 scale per token "
        f"and KV head {DEFAULT}",
        choices=KV_CACHE_DTYPE_NAMES,
    ),
    EngineOption("kv_policy", f"paged or a contiguous reservation {DEFAULT}", choices=POLICY_NAMES),
    EngineOption(
        "decode_headroom",
        "share of the running requests' remaining max_tokens that paged admission keeps KV room for; "
        f"0: admit on the prompt alone and preempt when the pool runs dry {DEFAULT}",
        unit_fraction,
    ),
    EngineOption(
        "scheduling_policy",
        "fcfs, or priority: a request's priority field orders admission and preemption, lower first "
        f"{DEFAULT}",
        choices=SCHEDULING_POLICIES,
    ),
    EngineOption(
        "min_priority",
        "under --scheduling-policy priority, the lowest (most urgent) priority a request may ask for; "
        f"0: clients may only yield {DEFAULT}",
        int,
    ),
    EngineOption(
        "max_priority",
        f"under --scheduling-policy priority, the highest priority a request may ask for {DEFAULT}",
        int,
    ),
    EngineOption(
        "max_running_share",
        "most of the running slots (--max-num-seqs) and KV blocks one client request may hold while "
        f"others wait; 1: no limit {DEFAULT}",
        share_fraction,
    ),
    EngineOption(
        "kv_offload_memory",
        "turn on a second KV tier of this size, all ranks together: a bare number is GiB (vLLM's), "
        "or e.g. 512MiB; evicted blocks spill to it and come back on a prefix hit (default: off)",
        offload_size,
        flag="--kv-offloading-size",
    ),
    EngineOption(
        "kv_offload",
        "the second KV tier's backend: native (pagedkv's own; the default once "
        "--kv-offloading-size is given)",
        choices=("native",),
        flag="--kv-offloading-backend",
    ),
    EngineOption(
        "kv_offload_dir",
        "keep the second KV tier on disk in this folder (default: host RAM); a restarted server "
        "with the same model and KV layout finds its blocks again",
    ),
    EngineOption(
        "preemption_mode",
        "how a preempted request leaves the pool: swap (to the second tier) or recompute "
        "(default: whichever costs less, per request)",
        choices=("swap", "recompute"),
    ),
    EngineOption("attention_backend", "torch, cpu or triton (default: triton on CUDA, else cpu)"),
    EngineOption(
        "enable_lora",
        "serve LoRA adapters (PEFT folders) beside the base model: --lora-modules, a request's lora",
        action="store_true",
    ),
    EngineOption(
        "max_loras", f"LoRA adapters resident at once; more wait for a slot {DEFAULT}", positive_int
    ),
    EngineOption(
        "max_lora_rank", f"the largest LoRA rank an adapter may have (at most 64) {DEFAULT}", positive_int
    ),
    EngineOption(
        "lora_paging",
        f"where resident LoRA adapters live: unified (pages of the KV block pool) or slots {DEFAULT}",
        choices=("unified", "slots"),
    ),
    EngineOption(
        "enforce_eager",
        "capture no CUDA graphs: decode steps run eagerly (graphs are captured only on CUDA, one rank)",
        action="store_true",
    ),
    EngineOption(
        "load_format",
        f"auto: the checkpoint's weights; dummy: seeded random weights of config.json's shape {DEFAULT}",
        choices=LOAD_FORMATS,
    ),
    EngineOption(
        "quantization",
        "quantize the decoder's projections of a 16/32-bit checkpoint when loading it, to this llama.cpp "
        "type (a GPTQ, AWQ or compressed-tensors checkpoint loads quantized without it; default: off)",
        choices=QUANTIZATION_NAMES,
    ),
    EngineOption(
        "quantized_activations",
        "how products with GGUF-block weights treat the activations: float (as they are, float32 sums), "
        "q8 (a decode step of a few rows rounds them to 8-bit blocks and sums integer products, "
        f"llama.cpp's arithmetic; more rows stay float) or q8-all (every product so, prefill too) {DEFAULT}",
        choices=QUANTIZED_ACTIVATIONS,
    ),
    EngineOption(
        "speculative_config",
        'speculative decoding, as JSON in vLLM\'s shape: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} (prompt lookup) or {"model": DIR or '
        '"stdlib-llama-draft", "num_speculative_tokens": 2} (a draft model with the same tokenizer); '
        "default: off",
        speculative_config,
    ),
    EngineOption(
        "tensor_parallel_size", f"ranks the model is sharded over, one process each {DEFAULT}", positive_int
    ),
    EngineOption("nnodes", f"machines the ranks run on (or launch with torchrun) {DEFAULT}", positive_int),
    EngineOption("node_rank", f"this machine's index; only machine 0 serves {DEFAULT}", int),
    EngineOption("master_addr", "address of machine 0, where the ranks meet (default: 127.0.0.1)"),
    EngineOption(
        "master_port",
        "port on machine 0 where the ranks meet (default: a free one, 29500 with --nnodes > 1)",
        positive_int,
    ),
    EngineOption(
        "distributed_timeout",
        f"seconds a collective waits for the other ranks before the engine fails {DEFAULT}",
        float,
    ),
    EngineOption(
        "threads_per_rank",
        "torch CPU threads of each rank (default: the process's threads shared by this machine's ranks)",
        positive_int,
    ),
    EngineOption("max_n", f"most samples per prompt {DEFAULT}", positive_int, is_limit=True),
    EngineOption("max_beam_width", f"most beams of a beam search {DEFAULT}", positive_int, is_limit=True),
    EngineOption(
        "max_request_tokens",
        "most tokens one request may ask for: samples x (prompt + max_tokens), summed over its prompts "
        "(default: what the KV pool holds, at most --max-num-seqs x the context length)",
        positive_int,
        is_limit=True,
    ),
    EngineOption("max_stop_strings", f"most stop strings per request {DEFAULT}", positive_int, is_limit=True),
    EngineOption(
        "max_stop_chars",
        f"most characters over all stop strings of a request {DEFAULT}",
        positive_int,
        is_limit=True,
    ),
    EngineOption(
        "max_stop_token_ids", f"most stop_token_ids per request {DEFAULT}", positive_int, is_limit=True
    ),
    EngineOption(
        "max_compile_seconds",
        f"a grammar still compiling after this many seconds is refused (400), and its spec from then on "
        f"{DEFAULT}",
        positive_float,
        is_structured=True,
    ),
    EngineOption(
        "max_spec_chars",
        f"longest schema, regex, grammar or choice list, in characters {DEFAULT}",
        positive_int,
        is_structured=True,
    ),
    EngineOption(
        "max_schema_depth", f"deepest nesting of a JSON schema {DEFAULT}", positive_int, is_structured=True
    ),
    EngineOption(
        "cache_size",
        f"compiled grammars kept, least recently used out first {DEFAULT}",
        positive_int,
        is_structured=True,
    ),
    EngineOption(
        "compile_threads",
        f"threads that compile grammars, off the engine's {DEFAULT}",
        positive_int,
        is_structured=True,
    ),
    EngineOption(
        "disable_any_whitespace",
        "JSON output without whitespace between its tokens beyond one space after ':' and ',', whatever "
        "the request says (small models tend to loop on whitespace)",
        action="store_true",
        is_structured=True,
    ),
    EngineOption(
        "any_whitespace",
        "JSON output may hold any run of whitespace between its tokens (by default at most one space, "
        "as outlines allows: small models can loop on whitespace)",
        action="store_true",
        is_structured=True,
    ),
)
