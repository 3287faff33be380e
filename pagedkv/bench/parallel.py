"""``pagedkv bench parallel``: tensor parallelism's speed-up, and what its all-reduces cost.

Two engines over the same model in one process: one rank with T threads, and two ranks with T
threads each (rank 0 in this process, rank 1 in its own; see
:mod:`pagedkv.engine.executor.multiproc`). Each workload runs on both, stepped in turn so a
burst of other work on the machine hits both alike, each on its own clock (the engine's step
times). Prefill-heavy: long prompts, one new token each; decode: short prompts, many new
tokens. Rank 0 counts its calls to and time inside the forward pass's collectives (two
all-reduces per layer, one for the embedding, the logits' gather), waiting for the other rank
included: that is their cost per step. Greedy tokens of the two engines must agree.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.bench.driver import FIRST_TOKEN_ID, EngineOptions, MeasuredEngine, run_settings, step_in_turn


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    max_tokens: int


@dataclass(frozen=True)
class ParallelConfig:
    model: Path
    engine: EngineOptions
    workloads: tuple[Workload, ...]
    threads: int = 1
    tensor_parallel_size: int = 2
    repeats: int = 3
    seed: int = 0


@dataclass
class WorkloadResult:
    workload: Workload
    #: tokens computed per second of engine time (prompt and generated), one figure per repeat
    single_tps: list[float] = field(default_factory=list)
    parallel_tps: list[float] = field(default_factory=list)
    steps: int = 0
    collective_calls: int = 0
    collective_s: float = 0.0
    parallel_s: float = 0.0
    same_tokens: bool = True
    #: a step's all-reduces timed alone (see parallel_collectives): rows of the largest step
    step_rows: int = 0
    all_reduce_alone_s: float = 0.0

    @property
    def speedup(self) -> float:
        return statistics.median(self.parallel_tps) / statistics.median(self.single_tps)

    @property
    def collective_ms_per_step(self) -> float:
        return 1e3 * self.collective_s / max(1, self.steps)

    @property
    def collective_share(self) -> float:
        return self.collective_s / self.parallel_s if self.parallel_s else 0.0

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self.workload),
            "single_tokens_per_s": statistics.median(self.single_tps),
            "parallel_tokens_per_s": statistics.median(self.parallel_tps),
            "speedup": self.speedup,
            "steps": self.steps,
            "collectives_per_step": self.collective_calls / max(1, self.steps),
            "collective_ms_per_step": self.collective_ms_per_step,
            "collective_share_of_step": self.collective_share,
            "same_tokens": self.same_tokens,
            "largest_step_tokens": self.step_rows,
            "all_reduces_alone_ms_per_step": 1e3 * self.all_reduce_alone_s,
        }


@dataclass
class ParallelResult:
    config: ParallelConfig
    results: list[WorkloadResult]

    @property
    def ok(self) -> bool:
        return all(r.same_tokens for r in self.results)

    def to_json(self) -> dict:
        return {
            "model": str(self.config.model),
            "threads_per_rank": self.config.threads,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "repeats": self.config.repeats,
            "workloads": [r.to_json() for r in self.results],
        }


def _prompts(workload: Workload, seed: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(workload.prompt_len)]
        for _ in range(workload.num_requests)
    ]


def _run_once(engines: list[MeasuredEngine], prompts: list[list[int]], max_tokens: int, tag: str) -> None:
    from pagedkv.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for measured in engines:
        for i, prompt in enumerate(prompts):
            measured.submit(f"{tag}-{i}", prompt, params)
    for _ in step_in_turn(engines):
        pass


def run_parallel(config: ParallelConfig) -> ParallelResult:
    with run_settings(config.threads):
        needed = max(w.num_requests * (w.prompt_len + w.max_tokens) for w in config.workloads)
        blocks = -(-needed // config.engine.run_block_size) + 8
        base = config.engine.engine_config(blocks, max(w.prompt_len + w.max_tokens for w in config.workloads))
        base = dataclasses.replace(
            base, model=str(config.model), enable_prefix_caching=False, threads_per_rank=config.threads
        )
        single = MeasuredEngine.start(base)
        tp = config.tensor_parallel_size
        parallel = MeasuredEngine.start(dataclasses.replace(base, tensor_parallel_size=tp))
        try:
            results = [_measure(config, w, single, parallel) for w in config.workloads]
        finally:
            parallel.engine.shutdown()
        _time_collectives_alone(results, single.engine.model_config, tp)
        return ParallelResult(config, results)


def _time_collectives_alone(results: list[WorkloadResult], model_config, world: int) -> None:
    """Each workload's largest step: its ``2 * layers + 1`` all-reduces, timed with nothing else."""
    from pagedkv.bench.parallel_collectives import time_all_reduces

    shapes = [(r.step_rows, model_config.hidden_size) for r in results]
    per_call = time_all_reduces(shapes, world=world)
    for result, seconds in zip(results, per_call, strict=True):
        result.all_reduce_alone_s = (2 * model_config.num_layers + 1) * seconds


def _measure(
    config: ParallelConfig, workload: Workload, single: MeasuredEngine, parallel: MeasuredEngine
) -> WorkloadResult:
    result = WorkloadResult(workload)
    stats = parallel.engine.executor.collective_stats
    vocab = single.engine.model_config.vocab_size
    for repeat in range(config.repeats):
        prompts = _prompts(workload, config.seed + repeat, vocab)
        marks = [(len(m.steps), m.clock) for m in (single, parallel)]
        calls, seconds = stats.calls, stats.seconds
        tag = f"{workload.name}-{repeat}"
        _run_once([single, parallel], prompts, workload.max_tokens, tag)
        for measured, (first, start), rates in zip(
            (single, parallel), marks, (result.single_tps, result.parallel_tps), strict=True
        ):
            tokens = sum(s.num_tokens for s in measured.steps[first:])
            rates.append(tokens / (measured.clock - start))
        result.steps += len(parallel.steps) - marks[1][0]
        result.step_rows = max(s.num_tokens for s in parallel.steps[marks[1][0] :])
        result.parallel_s += parallel.clock - marks[1][1]
        result.collective_calls += stats.calls - calls
        result.collective_s += stats.seconds - seconds
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        result.same_tokens &= [single.outputs[i] for i in ids] == [parallel.outputs[i] for i in ids]
    return result


def print_parallel(result: ParallelResult, console) -> None:
    from rich.table import Table

    cfg = result.config
    table = Table(
        title=f"{cfg.tensor_parallel_size} ranks x {cfg.threads} thread(s) vs 1 rank x {cfg.threads} "
        f"thread(s), {cfg.model.name}, median of {cfg.repeats}"
    )
    for column in (
        "workload", "requests x prompt + new", "1 rank tok/s", f"{cfg.tensor_parallel_size} ranks tok/s",
        "speed-up", "collectives/step", "collective ms/step", "share of step", "all-reduces alone ms/step",
        "same tokens",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for r in result.results:
        w = r.workload
        table.add_row(
            w.name,
            f"{w.num_requests} x {w.prompt_len} + {w.max_tokens}",
            f"{statistics.median(r.single_tps):,.0f}",
            f"{statistics.median(r.parallel_tps):,.0f}",
            f"{r.speedup:.2f}x",
            f"{r.collective_calls / max(1, r.steps):.0f}",
            f"{r.collective_ms_per_step:.2f}",
            f"{r.collective_share:.0%}",
            f"{1e3 * r.all_reduce_alone_s:.2f} ({r.step_rows} rows)",
            "yes" if r.same_tokens else "NO",
        )
    console.print(table)
    console.print(
        "tok/s: tokens computed (prompt + generated) per second of engine time. Collective time is "
        "rank 0's, inside all-reduce and gather, waiting for the other rank included; 'alone': the "
        "largest step's all-reduces between two idle ranks, best of 20."
    )
