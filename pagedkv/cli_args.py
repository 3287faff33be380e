"""Command-line pieces shared by every subcommand: argument types and the engine's options.

Nothing here imports torch or FastAPI, so building the parser (and ``pagedkv --help``) stays
fast; the engine is imported only when a command builds one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedkv.bench import DEFAULT_OUT
from pagedkv.memory.manager import KV_POLICIES
from pagedkv.memory.spec import parse_bytes


def byte_size(text: str) -> int:
    """argparse type for '80GB', '256MiB', ...: keeps parse_bytes' message on bad input."""
    try:
        value = parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory size must be positive, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def add_report_options(parser: argparse.ArgumentParser) -> None:
    """``--out``, ``--no-plots`` and ``--json``: how a command that measures shows its figures."""
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out", type=Path, default=Path(DEFAULT_OUT), help="folder for the PNG plots (default: %(default)s)"
    )
    output.add_argument("--no-plots", action="store_true", help="do not write plots")
    output.add_argument("--json", action="store_true", help="print one JSON document instead of tables")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="Hugging Face model folder (config.json, *.safetensors, tokenizer); "
        "default: the built-in tiny Llama trained on the Python standard library",
    )
    group.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="(default: %(default)s)",
    )
    group.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    group.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16)"
    )
    group.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        default=None,
        help="KV blocks in the pool (default: from memory)",
    )
    group.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        default="256MiB",
        help="memory for the KV cache when --num-kv-blocks is not given (default: %(default)s)",
    )
    group.add_argument(
        "--max-model-len", type=positive_int, default=None, help="context length (default: the model's)"
    )
    group.add_argument(
        "--max-num-seqs", type=positive_int, default=64, help="most sequences per step (default: 64)"
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="most tokens per step (default: 2048)",
    )
    group.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    group.add_argument(
        "--kv-policy",
        choices=KV_POLICIES,
        default="paged",
        help="paged, or a contiguous reservation to compare with (default: %(default)s)",
    )
    group.add_argument(
        "--attention-backend", default=None, help="torch, cpu or triton (default: triton on CUDA, else cpu)"
    )


def engine_config(args: argparse.Namespace):
    from pagedkv.engine import EngineConfig

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
        enable_prefix_caching=not args.no_prefix_caching,
        kv_policy=args.kv_policy,
        attention_backend=args.attention_backend,
    )


def build_engine(args: argparse.Namespace):
    """The engine of the parsed options, with the built-in model's note on stderr; a bad option
    exits with status 2 through ``args.parser.error``."""
    from pagedkv.engine import LLMEngine
    from pagedkv.models import BUILTIN_NOTE

    try:
        engine = LLMEngine(engine_config(args))
    except (ValueError, FileNotFoundError) as err:
        args.parser.error(str(err))
    if engine.is_builtin:
        print(f"note: {BUILTIN_NOTE}", file=sys.stderr)
    return engine
