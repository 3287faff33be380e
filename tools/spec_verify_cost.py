"""What verifying k proposed tokens costs: one forward pass of k + 1 rows per sequence.

    .venv/bin/python tools/spec_verify_cost.py [--batch 1 8 32] [-k 0 1 2 4] [--context 256]
        [--threads 1] [--repeats 30] [--model DIR]

For each batch size, ``--batch`` sequences hold ``--context`` tokens of KV; one step plan gives
each of them ``k + 1`` query rows (``k = 0`` is a plain decode step) and asks for every row's
logits, as a verification step does. The rows are generated tokens (past the prompt), so every
step takes the C decode stack where the model has one. Printed per (batch, k): the median time
of ``executor.execute`` over ``--repeats`` runs, its ratio to the plain decode step, and the
median time of :class:`~pagedkv.engine.spec.rejection.RejectionSampler` over those logits
(greedy rows and seeded temperature-1 rows, proposals drawn at random so most are rejected).
Timings move with the machine's load: compare rows taken in one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from pagedkv import LLM
from pagedkv.engine.core.plan import SeqSlice, StepPlan
from pagedkv.engine.sample.sampler import make_generator
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.spec.rejection import RejectionSampler


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def verify_plan(
    llm: LLM, seq_ids: list[int], context: list[list[int]], k: int, rng: random.Random
) -> StepPlan:
    vocab = llm.engine.model_config.vocab_size
    slices = [
        SeqSlice(
            seq_id=seq_id,
            token_ids=[rng.randrange(4, vocab) for _ in range(k + 1)],
            start=len(tokens),
            needs_logits=True,
            prompt_len=len(tokens),  # the context is the prompt, the k + 1 rows generated tokens
            num_spec_tokens=k,  # every row's logits, as verification needs
        )
        for seq_id, tokens in zip(seq_ids, context, strict=True)
    ]
    # rerunning a plan applies its table edits again, which leaves the runner's tables as they are
    return llm.engine.shipped_tables.plan(slices, llm.engine.kv_manager)


def sampler_inputs(batch: int, k: int, vocab: int, rng: random.Random, greedy: bool) -> tuple:
    drafts = [[rng.randrange(4, vocab) for _ in range(k)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=1.0, seed=0)
    return drafts, [params] * batch, [[] for _ in range(batch)], [[1, 2, 3]] * batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("-k", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", default=None, help="HF model folder (default: the built-in model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="float32", num_kv_blocks=4096, enable_prefix_caching=False)
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.model_config.vocab_size
    sampler = RejectionSampler()
    print(f"{engine.describe()}; context {args.context}, {args.threads} thread(s)")
    print("batch  k  forward ms  vs k=0  greedy verify us  seeded verify us")
    for batch in args.batch:
        seq_ids = [f"b{batch}-{i}" for i in range(batch)]
        context = [[rng.randrange(4, vocab) for _ in range(args.context)] for _ in range(batch)]
        for seq_id, tokens in zip(seq_ids, context, strict=True):
            engine.kv_manager.allocate(seq_id, tokens, reserve_tokens=args.context + max(args.k) + 1)
        base = None
        for k in args.k:
            plan = verify_plan(llm, seq_ids, context, k, rng)
            forward = median_seconds(lambda plan=plan: engine.executor.execute(plan), args.repeats)
            base = base or forward
            logits = engine.executor.execute(plan)
            timings = []
            for greedy in (True, False):
                inputs = sampler_inputs(batch, k, vocab, rng, greedy)
                params = inputs[1]
                generators = [
                    None if p.seed is None else make_generator(p.seed, i) for i, p in enumerate(params)
                ]

                def verify(logits=logits, inputs=inputs, generators=generators) -> None:
                    drafts, params, outputs, prompts = inputs
                    sampler(logits, drafts, params, generators, outputs, prompts)

                timings.append(median_seconds(verify, args.repeats))
            print(
                f"{batch:5d} {k:2d}  {forward * 1e3:10.2f}  {forward / base:6.2f}  "
                f"{timings[0] * 1e6:16.0f}  {timings[1] * 1e6:16.0f}"
            )
        for seq_id in seq_ids:
            engine.kv_manager.free(seq_id)


if __name__ == "__main__":
    main()
