"""``pagedkv bench parallel``: tensor parallelism's speed-up, and what its all-reduces cost.

Two engines over the same model in one process: one rank with T threads, and N ranks with T
threads each (rank 0 in this process, the others in their own; see
:mod:`pagedkv.engine.worker.executor.multiproc`). Each workload runs on both, stepped in turn, each on
its own clock. Prefill-heavy: long prompts, one new token each; decode: short prompts, many new
tokens. Rank 0 counts its calls to and time inside the forward pass's collectives (two
all-reduces per layer, one for the embedding, the logits' gather), waiting for the other ranks
included: that is their cost per step. Then each workload's largest step's all-reduces are timed
alone, between ranks that do nothing else (:func:`time_all_reduces`). Greedy tokens of the two
engines must agree.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import random
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from rich.console import Console

from pagedkv.bench.driver import (
    FIRST_TOKEN_ID,
    EngineOptions,
    MeasuredEngine,
    progress,
    run_settings,
    step_in_turn,
    table,
)
from pagedkv.bench.options import check_options, option
from pagedkv.cli_report import DEFAULT_OUT

WORKLOADS = "workloads: requests x prompt tokens + new tokens"


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = option(2, "ranks of the parallel engine", positive=True)
    threads: int = option(1, "threads per rank", positive=True)
    repeats: int = option(3, "runs per figure", positive=True)
    seed: int = option(0, "prompt seed")
    prefill: tuple[int, ...] = option(
        (4, 512, 1), "", positive=True, nargs=3, metavar=("R", "P", "N"), group=WORKLOADS
    )
    decode: tuple[int, ...] = option(
        (8, 16, 64), "", positive=True, nargs=3, metavar=("R", "P", "N"), group=WORKLOADS
    )
    engine: EngineOptions = field(default_factory=EngineOptions)
    #: where the bench model is made when the engine options name no model
    out: Path = Path(DEFAULT_OUT)

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def workloads(self) -> dict[str, tuple[int, ...]]:
        return {"prefill": self.prefill, "decode": self.decode}


@dataclass
class WorkloadResult:
    name: str
    num_requests: int
    prompt_len: int
    max_tokens: int
    #: tokens computed per second of engine time (prompt and generated), one figure per repeat
    single_tps: list[float] = field(default_factory=list)
    parallel_tps: list[float] = field(default_factory=list)
    steps: int = 0
    collective_calls: int = 0
    collective_s: float = 0.0
    parallel_s: float = 0.0
    same_tokens: bool = True
    #: the rows of the workload's largest step, and its all-reduces timed alone
    step_rows: int = 0
    all_reduce_alone_s: float = 0.0

    @property
    def speedup(self) -> float:
        return statistics.median(self.parallel_tps) / statistics.median(self.single_tps)

    def to_json(self) -> dict:
        steps = max(1, self.steps)
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
            "single_tokens_per_s": statistics.median(self.single_tps),
            "parallel_tokens_per_s": statistics.median(self.parallel_tps),
            "speedup": self.speedup,
            "steps": self.steps,
            "collectives_per_step": self.collective_calls / steps,
            "collective_ms_per_step": 1e3 * self.collective_s / steps,
            "collective_share_of_step": self.collective_s / self.parallel_s if self.parallel_s else 0.0,
            "same_tokens": self.same_tokens,
            "largest_step_tokens": self.step_rows,
            "all_reduces_alone_ms_per_step": 1e3 * self.all_reduce_alone_s,
        }


@dataclass
class ParallelResult:
    config: ParallelConfig
    model: Path
    results: list[WorkloadResult]

    @property
    def ok(self) -> bool:
        return all(r.same_tokens for r in self.results)

    def to_json(self) -> dict:
        return {
            "config": dataclasses.asdict(self.config),
            "model": str(self.model),
            "workloads": [r.to_json() for r in self.results],
        }


def run_parallel(config: ParallelConfig) -> ParallelResult:
    from pagedkv.bench.bench_model import bench_model_path

    model = Path(config.engine.model) if config.engine.model else bench_model_path(config.out / "models")
    shapes = config.workloads.values()
    with run_settings(config.threads):
        blocks = -(-max(r * (p + n) for r, p, n in shapes) // config.engine.run_block_size) + 8
        base = config.engine.engine_config(blocks, max(p + n for _, p, n in shapes))
        base = dataclasses.replace(
            base, model=str(model), enable_prefix_caching=False, threads_per_rank=config.threads
        )
        single = MeasuredEngine.start(base)
        parallel = MeasuredEngine.start(
            dataclasses.replace(base, tensor_parallel_size=config.tensor_parallel_size)
        )
        try:
            results = [
                _measure(config, name, shape, single, parallel) for name, shape in config.workloads.items()
            ]
        finally:
            parallel.engine.shutdown()
        model_config = single.engine.model_config
        progress("parallel: the largest steps' all-reduces, timed alone")
        per_call = time_all_reduces(
            [(r.step_rows, model_config.hidden_size) for r in results], world=config.tensor_parallel_size
        )
        for result, seconds in zip(results, per_call, strict=True):
            result.all_reduce_alone_s = (2 * model_config.num_layers + 1) * seconds
        return ParallelResult(config, model, results)


def _measure(
    config: ParallelConfig,
    name: str,
    shape: tuple[int, ...],
    single: MeasuredEngine,
    parallel: MeasuredEngine,
) -> WorkloadResult:
    from pagedkv.engine import SamplingParams

    result = WorkloadResult(name, *shape)
    num_requests, prompt_len, max_tokens = shape
    stats = parallel.engine.executor.collective_stats
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for repeat in range(config.repeats):
        progress(f"parallel: {name}, run {repeat + 1} of {config.repeats}")
        rng = random.Random(config.seed + repeat)
        vocab = single.engine.model_config.vocab_size
        prompts = [
            [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(prompt_len)] for _ in range(num_requests)
        ]
        marks = [(len(m.steps), m.clock) for m in (single, parallel)]
        calls, seconds = stats.calls, stats.seconds
        ids = [f"{name}-{repeat}-{i}" for i in range(num_requests)]
        for measured in (single, parallel):
            for request_id, prompt in zip(ids, prompts, strict=True):
                measured.submit(request_id, prompt, params)
        step_in_turn([single, parallel])
        for measured, (first, start), rates in zip(
            (single, parallel), marks, (result.single_tps, result.parallel_tps), strict=True
        ):
            rates.append(sum(s.num_tokens for s in measured.steps[first:]) / (measured.clock - start))
        result.steps += len(parallel.steps) - marks[1][0]
        result.step_rows = max(s.num_tokens for s in parallel.steps[marks[1][0] :])
        result.parallel_s += parallel.clock - marks[1][1]
        result.collective_calls += stats.calls - calls
        result.collective_s += stats.seconds - seconds
        result.same_tokens &= [single.outputs[i] for i in ids] == [parallel.outputs[i] for i in ids]
    return result


def _all_reduce_rounds(
    rank: int, world: int, port: int, shapes: list[tuple[int, int]], repeats: int
) -> list[float]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=world, timeout=timedelta(minutes=5)
    )
    try:
        seconds = []
        for shape in shapes:
            tensor = torch.ones(shape)
            dist.all_reduce(tensor)  # warm the connection
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                started = time.perf_counter()
                dist.all_reduce(tensor)
                best = min(best, time.perf_counter() - started)
            seconds.append(best)
        return seconds
    finally:
        dist.destroy_process_group()


def time_all_reduces(shapes: list[tuple[int, int]], repeats: int = 20, world: int = 2) -> list[float]:
    """Seconds of one all-reduce of each ``[tokens, hidden]`` shape among ``world`` ranks that
    start each round together (a barrier) and do nothing else: the collective's own cost, best of
    ``repeats`` (the least disturbed by other work); rank 0 here, the others spawned. Call it with
    no tensor-parallel engine alive in this process."""
    from pagedkv.distributed.rendezvous import free_port

    port = free_port("127.0.0.1")
    context = multiprocessing.get_context("spawn")
    others = [
        context.Process(target=_all_reduce_rounds, args=(rank, world, port, shapes, repeats), daemon=True)
        for rank in range(1, world)
    ]
    for process in others:
        process.start()
    try:
        return _all_reduce_rounds(0, world, port, shapes, repeats)
    finally:
        for process in others:
            process.join(30)
            if process.is_alive():
                process.kill()


def print_parallel(result: ParallelResult, console: Console) -> None:
    cfg, ranks = result.config, result.config.tensor_parallel_size
    parallel = table(
        f"{ranks} ranks x {cfg.threads} thread(s) vs 1 rank x {cfg.threads} thread(s), {result.model.name}, "
        f"median of {cfg.repeats}",
        (
            "workload", "requests x prompt + new", "1 rank tok/s", f"{ranks} ranks tok/s", "speed-up",
            "collectives/step", "collective ms/step", "share of step", "all-reduces alone ms/step",
            "same tokens",
        ),
        left=0,
    )  # fmt: skip
    for r in result.results:
        figures = r.to_json()
        parallel.add_row(
            r.name,
            f"{r.num_requests} x {r.prompt_len} + {r.max_tokens}",
            f"{figures['single_tokens_per_s']:,.0f}",
            f"{figures['parallel_tokens_per_s']:,.0f}",
            f"{r.speedup:.2f}x",
            f"{figures['collectives_per_step']:.0f}",
            f"{figures['collective_ms_per_step']:.2f}",
            f"{figures['collective_share_of_step']:.0%}",
            f"{1e3 * r.all_reduce_alone_s:.2f} ({r.step_rows} rows)",
            "yes" if r.same_tokens else "NO",
        )
    console.print(parallel)
    console.print(
        "tok/s: tokens computed (prompt + generated) per second of engine time. Collective time is "
        "rank 0's, inside all-reduce and gather, waiting for the other ranks included; 'alone': the "
        "largest step's all-reduces between idle ranks, best of 20."
    )
