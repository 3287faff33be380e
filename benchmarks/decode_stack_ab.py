"""A/B of the C decode stack (pagedkv.models.decode_stack) against the step program alone.

Two engines on issue 12's bench model in one process, one with the stack and one whose step
program has none, take turns on the same requests; each round's tokens/s is printed and the
greedy ids of the two are checked equal (the stack computes the program's hidden states bit for
bit, so they must be). Example::

    .venv/bin/python benchmarks/decode_stack_ab.py --workload mixed --rounds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.bench.throughput_model import bench_model_path
from pagedkv.bench.throughput_workloads import WORKLOAD_NAMES, WorkloadShape, build_workload
from pagedkv.models.step_program import StepProgram


def _engine(folder: Path, dtype: str, stack: bool) -> LLM:
    llm = LLM(str(folder), dtype=dtype, enable_prefix_caching=False, skip_tokenizer_init=True)
    model = llm.engine.executor.runner.model
    program = StepProgram.of(model)
    if program.stack is None:
        raise SystemExit("this machine has no decode stack for the bench model (a kernel did not build)")
    model.step_program = program if stack else dataclasses.replace(program, stack=None)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, default="mixed")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model-dir", type=Path, default=Path("pagedkv-report"), help="where the bench model is kept"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = bench_model_path(args.model_dir)
    engines = {"stack": _engine(folder, args.dtype, True), "program": _engine(folder, args.dtype, False)}
    shape = WorkloadShape(1, 128, 128) if args.workload == "single" else WorkloadShape(32, 128, 128)
    workload = build_workload(args.workload, shape, vocab_size=32000)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens]
    rates: dict[str, list[float]] = {name: [] for name in engines}
    ids: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds):
        for name in list(engines) if round_ % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            outputs = engines[name].generate([list(p) for p in workload.prompts], params, use_tqdm=False)
            rates[name].append(workload.generated_tokens / (time.perf_counter() - start))
            ids[name] = [list(o.outputs[0].token_ids) for o in outputs]
    print(f"{args.workload}, {args.dtype}, {args.threads} threads: generated tokens/s per round")
    for name, values in rates.items():
        print(f"  {name:8s} " + " ".join(f"{v:7.1f}" for v in values) + f"   best {max(values):.1f}")
    print(f"  stack / program, best rounds: {max(rates['stack']) / max(rates['program']):.3f}")
    if ids["stack"] != ids["program"]:
        raise SystemExit("the two engines' greedy ids differ: the stack is not the program's arithmetic")
    print("  greedy ids equal")


if __name__ == "__main__":
    main()
