"""Forward-pass time with the fused C layer ops against the torch ops, in one process.

    .venv/bin/python benchmarks/layer_ops.py --model MODEL_DIR [--dtypes float32 bfloat16]
        [--batches 1 32] [--context 256] [--rounds 6] [--threads N]

Times ``runner.model(...)`` for one decode step (each sequence at ``--context`` cached tokens),
alternating the two op sets round by round so a burst of other work on a shared machine hits
both alike; also times the same step's linear layers and attention calls alone, so that
``forward - (linears + attention)`` is what the element-wise ops and Python cost. Each figure
is the best round's 25th-percentile call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedkv import LLM
from pagedkv.attention import attend
from pagedkv.engine.executor.plan import SeqSlice, StepPlan
from pagedkv.models import layer_ops


def quartile_seconds(fn: Callable[[], object], calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 4]


def measure(path: str, dtype: str, batch: int, context: int, rounds: int) -> dict[str, float]:
    llm = LLM(path, dtype=dtype, num_kv_blocks=batch * (context // 16 + 2), enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    model, per_seq = runner.model, context // 16 + 1
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    inputs = runner.prepare(StepPlan([SeqSlice([7], context, table, True) for table in tables]))
    layers = model.model.layers
    attn = layers[0].self_attn
    x = model.model.embed_tokens(inputs.input_ids)
    q = torch.randn(batch, attn.num_heads, attn.head_dim, dtype=x.dtype)
    o_in = torch.randn(batch, attn.num_heads * attn.head_dim, dtype=x.dtype)
    down_in = torch.randn(batch, layers[0].mlp.intermediate_size, dtype=x.dtype)

    def core() -> None:
        for i, layer in enumerate(layers):
            a = layer.self_attn
            a.qkv_proj(x)
            attend(q, runner.kv_cache.layers[i], inputs.metadata, a.options, a.backend)
            a.o_proj(o_in)
            layer.mlp.gate_up_proj(x)
            layer.mlp.down_proj(down_in)

    def forward() -> None:
        model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.metadata)

    fused = layer_ops.select
    best = {"linears+attention": [], "torch ops": [], "fused": []}
    try:
        with torch.inference_mode():
            for _ in range(5):
                core()
                forward()
            for _ in range(rounds):
                best["linears+attention"].append(quartile_seconds(core))
                layer_ops.select = lambda _x: layer_ops.TORCH_OPS
                best["torch ops"].append(quartile_seconds(forward))
                layer_ops.select = fused
                best["fused"].append(quartile_seconds(forward))
    finally:
        layer_ops.select = fused
    return {name: min(values) * 1e3 for name, values in best.items()}


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"decode step forward, ms (threads {torch.get_num_threads()}, context {args.context})")
    for dtype in args.dtypes:
        for batch in args.batches:
            ms = measure(args.model, dtype, batch, args.context, args.rounds)
            core, plain, fused = ms["linears+attention"], ms["torch ops"], ms["fused"]
            print(
                f"{dtype:9s} batch {batch:3d}: torch ops {plain:7.3f}  fused {fused:7.3f}  "
                f"({plain / fused:.2f}x) | linears+attention {core:7.3f}: the rest {plain - core:6.3f} "
                f"-> {fused - core:6.3f}"
            )


if __name__ == "__main__":
    main()
