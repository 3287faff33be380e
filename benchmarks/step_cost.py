"""What an engine step costs outside the model's forward pass, part by part, per decode step.

    .venv/bin/python benchmarks/step_cost.py --batch 32 --dtype float32 [--no-forward]

Runs ``LLM.generate`` over ``--batch`` random 128-token prompts (greedy, EOS ignored, prefix
caching off: the shape of ``pagedkv bench throughput``) and times each stage of every step with
``perf_counter`` around the engine's own methods: schedule, plan, prepare (plan -> tensors),
forward, compute_logits, sample, process outputs, stats. Prints the median over the decode
steps of each part, and ``outside`` = step - forward - compute_logits.

``--no-forward`` replaces the model by stored logits (``prepare`` still runs): the engine's cost
alone, with warm caches, about half what the same code costs between real forward passes.

For an A/B against another checkout, run the same command with ``PYTHONPATH=<its root>`` (a part
that checkout lacks prints 0). Timings move with the machine's load: compare runs taken together.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.bench.throughput_model import bench_model_path
from pagedkv.engine import engine as engine_module

PARTS = ("schedule", "plan", "prepare", "forward", "logits", "sample", "process", "stats", "step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=None, help="HF model folder (default: issue 12's bench model)")
    parser.add_argument("--no-forward", action="store_true", help="stored logits instead of the model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or str(bench_model_path(Path("pagedkv-report")))
    llm = LLM(model, dtype=args.dtype, num_kv_blocks=1000, max_num_seqs=64, enable_prefix_caching=False)
    engine = llm.engine
    runner = engine.executor.runner
    current: dict[str, float] = defaultdict(float)
    steps: list[dict[str, float]] = []

    def timed(owner: object, name: str, part: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            current[part] += time.perf_counter() - start
            if part == "step":
                steps.append(dict(current))
                current.clear()
            return result

        setattr(owner, name, wrapper)

    if args.no_forward:
        stored = torch.randn(4096, runner.model.config.vocab_size)

        def execute(plan):
            runner.prepare(plan)
            return stored[: plan.num_logits]

        engine.executor.execute = execute
    timed(engine, "step", "step")
    timed(engine.scheduler, "schedule", "schedule")
    timed(engine_module.SchedulerOutput, "plan", "plan")
    timed(runner, "prepare", "prepare")
    timed(runner.model, "forward", "forward")
    timed(runner.model, "compute_logits", "logits")
    timed(engine, "_sample", "sample")
    timed(engine.output_processor, "process", "process")
    timed(engine.stats_collector, "record_step", "stats")

    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(4, vocab) for _ in range(128)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    steps.clear()
    llm.generate(prompts, params, use_tqdm=False)
    decode = steps[-(args.max_tokens - 1) :]  # the steps after the prompts' prefill
    median = {part: statistics.median(s.get(part, 0.0) for s in decode) * 1e6 for part in PARTS}
    outside = statistics.median(s["step"] - s.get("forward", 0.0) - s.get("logits", 0.0) for s in decode)
    mode = "no forward (stored logits)" if args.no_forward else "with the forward"
    print(f"batch {args.batch}, {args.dtype}, {mode}: median us per decode step over {len(decode)} steps")
    print("  " + "  ".join(f"{part} {median[part]:.1f}" for part in PARTS) + f"  outside {outside * 1e6:.1f}")


if __name__ == "__main__":
    main()
