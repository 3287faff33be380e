"""A/B of pagedkv engine options on one workload, interleaved in one process.

On a shared machine absolute tokens/s move with the neighbours' load; running variants
alternately, several rounds, and keeping each one's best round gives ratios that hold. Example
(the linear kernel, float32, the throughput benchmark's model, 1 thread)::

    .venv/bin/python tools/engine_ab.py --dtype float32 --threads 1 \\
        --variant linear_kernel=torch --variant linear_kernel=auto

Each variant is an ``EngineConfig`` override (``field=value``); tokens are checked equal
across variants only when asked (``--same-tokens``): kernels that sum in another order may
flip a near-tie argmax.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.bench.bench_model import bench_model_path
from pagedkv.bench.throughput import WORKLOAD_NAMES, WorkloadShape, build_workload


def _variant(text: str) -> dict[str, object]:
    options: dict[str, object] = {}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        options[key] = int(value) if value.isdigit() else value
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", type=_variant, action="append", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, default="uniform")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--same-tokens", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or bench_model_path(Path("pagedkv-report") / "models")
    shape = WorkloadShape(args.num_requests, args.prompt_len, args.max_tokens)
    workload = build_workload(args.workload, shape, vocab_size=32000)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens]
    prompts = [list(p) for p in workload.prompts]
    engines = []
    for options in args.variant:
        llm = LLM(str(model), dtype=args.dtype, enable_prefix_caching=False, **options)
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        engines.append((options, llm))
        print(f"{options}: {llm!r}", flush=True)
    best = [0.0] * len(engines)
    tokens: list[list[list[int]]] = [[] for _ in engines]
    for round_ in range(args.rounds):
        for i, (options, llm) in enumerate(engines):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rate = workload.generated_tokens / (time.perf_counter() - start)
            best[i] = max(best[i], rate)
            tokens[i] = [list(o.outputs[0].token_ids) for o in outs]
            print(f"round {round_ + 1} {options}: {rate:,.1f} generated tok/s", flush=True)
    for (options, _), rate in zip(engines, best, strict=True):
        print(f"best {options}: {rate:,.1f} tok/s ({rate / best[0]:.2f}x the first)")
    if args.same_tokens and any(t != tokens[0] for t in tokens):
        raise SystemExit("variants generated different tokens")


if __name__ == "__main__":
    main()
