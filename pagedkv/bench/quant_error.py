"""Why one scale per token and KV head: the quantizer's error on real keys and values.

Runs the first tokens of held-out standard-library files (never trained on) through the built-in
model with an unquantized cache, reads back every full block it wrote, and quantizes those keys
and values two ways: one scale per token and KV head (what pagedkv stores) and one scale per
block and KV head (the amax over the block's tokens, what a per-block scheme would hold once
the block is full). Prints the relative RMS error ``||x' - x|| / ||x||`` of each.

    python -m pagedkv.bench.quant_error [--files 8] [--tokens 1024] [--block-size 16]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.quant import KV_CACHE_DTYPES, dequantize, quantize
from pagedkv.models.training.stdlib_text import read_sources, split_files


def full_blocks(data: torch.Tensor) -> torch.Tensor:
    """``data [L, 2, N, bs, H, D]`` -> the blocks every slot of which was written (a zeroed pool:
    an unwritten slot is all zeros), ``[L, 2, n, bs, H, D]``."""
    written = data.float().abs().amax(dim=(-2, -1)) > 0  # [L, 2, N, bs]
    full = written.all(dim=-1).all(dim=1).all(dim=0)  # [N]
    return data[:, :, full]


def relative_error(x: torch.Tensor, dtype: torch.dtype, per_block: bool) -> float:
    """``x [..., n, bs, H, D]`` quantized per token and head, or per block and head."""
    if per_block:
        grouped = x.transpose(-3, -2).flatten(-2)  # [..., n, H, bs * D]: one amax per block and head
        stored, scale = quantize(grouped, dtype)
        back = dequantize(stored, scale).view(*x.shape[:-3], x.shape[-2], x.shape[-3], x.shape[-1])
        back = back.transpose(-3, -2)
    else:
        stored, scale = quantize(x, dtype)
        back = dequantize(stored, scale)
    return float((back - x).norm() / x.norm())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=8, help="held-out files (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of each (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default: %(default)s)")
    args = parser.parse_args(argv)
    llm = LLM(block_size=args.block_size, enable_prefix_caching=False, dtype="float32")
    kv_cache = llm.engine.executor.runner.kv_cache
    _, held_out = split_files()
    blocks = []
    for text in read_sources(held_out[: args.files]):
        ids = llm.tokenizer.encode(text)[: args.tokens]
        kv_cache.data.zero_()
        llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
        blocks.append(full_blocks(kv_cache.data))
    kv = torch.cat(blocks, dim=2).float()
    num_tokens = kv.shape[2] * kv.shape[3]
    print(f"built-in model, {num_tokens} held-out tokens, block size {args.block_size}: relative RMS error")
    print(f"{'kv_cache_dtype':>14} {'scale per':>16} {'keys':>8} {'values':>8}")
    for name, dtype in KV_CACHE_DTYPES.items():
        if dtype is None:
            continue
        for per_block in (False, True):
            keys, values = (relative_error(kv[:, i], dtype, per_block) for i in (0, 1))
            granularity = "block and head" if per_block else "token and head"
            print(f"{name:>14} {granularity:>16} {keys:>8.4f} {values:>8.4f}")


if __name__ == "__main__":
    main()
