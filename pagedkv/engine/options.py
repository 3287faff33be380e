"""Engine options on the command line, shared by ``generate``, ``serve`` and the benchmarks."""

from __future__ import annotations

import argparse

from pagedkv.engine.engine import EngineConfig
from pagedkv.engine.scheduler import KV_POLICIES


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer); "
        "default: the built-in tiny Llama with random weights",
    )
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    group.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    group.add_argument(
        "--kv-cache-memory", default="256MiB", help="KV pool size as memory when --num-kv-blocks is not given"
    )
    group.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    group.add_argument("--max-num-seqs", type=int, default=64, help="running sequences per step")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="disable prefix caching",
    )
    group.add_argument("--kv-policy", choices=KV_POLICIES, default="paged", help="KV allocation policy")
    group.add_argument("--attention-backend", default=None, help="torch, cpu or triton (default: by device)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_policy=args.kv_policy,
        attention_backend=args.attention_backend,
    )
