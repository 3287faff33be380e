"""A/B of one code path inside the engine: the same engine, the path on and off in turn.

Some speed-ups are code paths, not engine options, so ``engine_ab.py`` cannot switch them. This
loads issue 12's bench model once and runs a ``pagedkv bench throughput`` workload with the path
on and off alternately, round after round (background load hits both alike), and prints the
best and median tokens/s of each and whether the greedy tokens are the same::

    .venv/bin/python benchmarks/path_ab.py prefill-tiles --dtype float32 --workload mixed --rounds 5
    .venv/bin/python benchmarks/path_ab.py fused-silu --dtype bfloat16

Paths: ``prefill-tiles`` (prefill runs on the attention kernel's tile entry, off: its row entry)
and ``fused-silu`` (``silu(gate) * up`` inside the tiled gate/up GEMM, off: the same paired
weight's product, then the separate op). The fused path gives the separate op's bits, so its
tokens are the same; the tiles sum in another order, so in bfloat16 near-tie tokens may differ.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import pagedkv.models.linear as linear
from pagedkv import LLM, SamplingParams
from pagedkv.attention.backends import cpu
from pagedkv.bench.throughput_model import bench_model_path
from pagedkv.bench.throughput_workloads import WorkloadShape, build_workload


def _switch(owner: object, name: str, off: Callable) -> Callable[[bool], None]:
    on = getattr(owner, name)
    return lambda enabled: setattr(owner, name, on if enabled else off)


PATHS: dict[str, Callable[[], Callable[[bool], None]]] = {
    "prefill-tiles": lambda: _switch(cpu, "_tile_rows", lambda *args: 0),
    "fused-silu": lambda: _switch(linear, "silu_mul_epilogue", lambda dtype: None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", choices=sorted(PATHS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", default="mixed", choices=["mixed", "uniform", "single"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = bench_model_path(Path("pagedkv-report"))
    workload = build_workload(args.workload, WorkloadShape(), 32000)
    llm = LLM(str(model), dtype=args.dtype, enable_prefix_caching=False, skip_tokenizer_init=True)
    prompts = [list(p) for p in workload.prompts]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # one-off costs on neither side
    switch = PATHS[args.path]()
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(args.rounds):
        for enabled in (False, True):
            switch(enabled)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds[enabled].append(time.perf_counter() - start)
            tokens[enabled] = [o.outputs[0].token_ids for o in outputs]
    switch(True)
    for enabled in (False, True):
        rates = [workload.generated_tokens / s for s in seconds[enabled]]
        label = f"{args.path} {'on' if enabled else 'off'}"
        print(f"{label:20s} best {max(rates):7.0f}  median {statistics.median(rates):7.0f} tok/s")
    print("same greedy tokens:", tokens[True] == tokens[False])


if __name__ == "__main__":
    main()
