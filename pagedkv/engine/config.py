"""EngineConfig: everything that sizes an engine, declared once with its defaults.

The command line (:mod:`pagedkv.cli_args`) and the benchmarks read their engine options'
defaults from here, so this module imports neither torch nor the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pagedkv.engine.kv_policy import KVPolicy
from pagedkv.engine.validation import RequestLimits

if TYPE_CHECKING:
    import torch


@dataclass
class EngineConfig:
    """Everything that sizes the engine. ``model=None`` means the built-in trained tiny Llama."""

    model: str | Path | None = None
    dtype: str | torch.dtype | None = "float32"
    device: str = "cpu"
    block_size: int = 16
    #: KV blocks in the pool; None: as many as ``kv_cache_memory`` holds.
    num_kv_blocks: int | None = None
    kv_cache_memory: str | int = "256MiB"
    #: Context length; None: the model's.
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    #: Share of the blocks kept free at admission, so running sequences can still grow.
    watermark: float = 0.01
    #: Share of each running request's remaining ``max_tokens`` that paged admission keeps room
    #: for (see ``engine/headroom.py``): 1.0 never over-commits when outputs run to max_tokens;
    #: 0 admits on the prompt alone and preempts when the pool runs dry.
    decode_headroom: float = 1.0
    #: "torch", "cpu" or "triton"; None: triton on CUDA, else cpu.
    attention_backend: str | None = None
    #: "paged", or "contiguous" / "contiguous-oracle" to measure the reservation it replaces.
    kv_policy: str | KVPolicy = "paged"
    #: The most one request may ask for (samples, beams, tokens).
    limits: RequestLimits = field(default_factory=RequestLimits)
