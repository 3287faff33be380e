"""``pagedkv bench capacity``: how many requests one KV budget serves at once, per KV policy.

One seeded workload (the simulator's length mixes) runs through three live engines that differ
only in their KV policy -- ``paged`` (blocks on demand), ``contiguous`` (``max_model_len`` slots
reserved per request at admission: the systems PagedAttention replaced) and
``contiguous-oracle`` (exactly prompt + ``max_tokens``) -- on the same model, pool size and
kernels. Every request is submitted at time 0 (an offline batch): a closed system, which is what
"how many fit" measures.

The engines are stepped in turn, one step each, and every policy keeps its own clock: the sum of
its own step times. On a shared machine a burst of background load then hits all three alike
rather than whichever policy happened to be running, and a request's time to first token is its
engine's clock when that token came out, since every request arrived at 0.

Averages over time are per engine step (each step counts once), so they are reproducible;
throughput and latencies use wall time. "Once the batch is full" is the window from the first
step after which the next waiting request did not fit in free KV memory to the first step after
which nothing waits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from pagedkv.cli_args import add_report_options
from pagedkv.engine.kv_policy import CONTIGUOUS, CONTIGUOUS_ORACLE, KV_POLICIES, PAGED, KVPolicy
from pagedkv.sim.experiments import capacity
from pagedkv.sim.workloads import Workload

if TYPE_CHECKING:
    from pagedkv.engine import EngineConfig

# The engine, and so torch, is imported only when a run starts: building the CLI parser stays fast.

#: Workloads without shared prefixes: with sharing, "tokens stored" would count a block twice.
WORKLOADS = ("normal", "sharegpt")
#: The simulator's allocator that models each engine policy.
SIM_ALLOCATORS = {PAGED: "paged", CONTIGUOUS: "max", CONTIGUOUS_ORACLE: "oracle"}
#: The simulator's capacity figure is one random snapshot; its prediction averages this many.
SIM_DRAWS = 16


@dataclass(frozen=True)
class CapacityConfig:
    """The run. ``scale`` divides every length -- prompts, outputs, ``max_model_len``, the KV
    budget, the block size and the per-step token budget -- so a scaled run keeps the shape of the
    full one with ``scale`` times fewer tokens."""

    workload: str = "normal"
    num_requests: int = 128
    kv_tokens: int = 16 * 2048
    max_model_len: int = 2048
    block_size: int = 16
    scale: int = 1
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    model: str | None = None
    dtype: str = "float32"
    attention_backend: str | None = None
    #: torch CPU threads during the run; None keeps torch's default.
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        for name in ("num_requests", "kv_tokens", "max_model_len", "block_size", "scale", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "kv_tokens", "max_num_batched_tokens"):
            if getattr(self, name) % self.scale:
                raise ValueError(f"scale {self.scale} must divide {name} ({getattr(self, name)})")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise ValueError(f"threads must be a positive integer or None, got {self.threads!r}")
        if self.max_model_len // self.scale < 2:
            raise ValueError(f"max_model_len {self.max_model_len} / scale {self.scale} leaves < 2 tokens")
        if self.kv_tokens < self.max_model_len:
            raise ValueError(
                f"a KV budget of {self.kv_tokens} tokens cannot hold even one contiguous reservation "
                f"of max_model_len={self.max_model_len} tokens"
            )
        if (self.kv_tokens // self.scale) % self.run_block_size:
            raise ValueError(
                f"the KV budget ({self.kv_tokens} tokens / scale {self.scale}) must be a whole number "
                f"of {self.run_block_size}-token blocks"
            )

    @property
    def run_max_model_len(self) -> int:
        return self.max_model_len // self.scale

    @property
    def run_block_size(self) -> int:
        return max(1, self.block_size // self.scale)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_tokens // self.scale // self.run_block_size

    def engine_config(self, policy: KVPolicy) -> EngineConfig:
        from pagedkv.engine import EngineConfig

        # No watermark: the budget is exactly kv_tokens for every policy, so contiguous-max
        # fits exactly kv_tokens // max_model_len requests.
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            block_size=self.run_block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.run_max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens // self.scale,
            enable_prefix_caching=self.enable_prefix_caching,
            watermark=0.0,
            attention_backend=self.attention_backend,
            kv_policy=policy,
        )

    def requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """(prompt token ids, max_tokens) per request: the simulator's lengths for this workload
        and seed, divided by ``scale``; token ids drawn from the vocabulary with the same seed."""
        lengths = Workload(self.workload, self.max_model_len).sample(
            np.random.default_rng(self.seed), self.num_requests
        )
        token_rng = np.random.default_rng([self.seed, 1])
        requests = []
        for r in lengths:
            prompt = max(1, r.prompt_len // self.scale)
            output = max(1, min(r.output_len // self.scale, self.run_max_model_len - prompt))
            requests.append((token_rng.integers(0, vocab_size, prompt).tolist(), output))
        return requests


@dataclass(frozen=True)
class StepSample:
    """One policy's state after one of its steps."""

    elapsed: float  # the policy's own clock at the end of the step, seconds
    running: int
    waiting: int
    used_blocks: int
    stored_tokens: int  # slots holding a real token (prompt or generated) in running sequences
    memory_blocked: bool  # the next waiting request does not fit in free KV memory


@dataclass
class PolicyRun:
    """Everything one policy did with the workload, and the figures derived from it."""

    policy: str
    block_size: int
    total_blocks: int
    samples: list[StepSample]
    ttft: list[float]
    generated_tokens: int
    preemptions: int
    #: Computed tokens that preemption threw away and that a prefix-cache hit did not bring back.
    recomputed_tokens: int
    blocks_used_after: int
    seqs_after: int

    @property
    def wall_s(self) -> float:
        return self.samples[-1].elapsed if self.samples else 0.0

    @property
    def steps(self) -> int:
        return len(self.samples)

    @property
    def peak_running(self) -> int:
        return max((s.running for s in self.samples), default=0)

    def utilization(self, sample: StepSample) -> float:
        return sample.stored_tokens / (sample.used_blocks * self.block_size)

    @property
    def full_window(self) -> list[StepSample]:
        """Steps from the first one after which memory blocked admission, until nothing waits."""
        start = next((i for i, s in enumerate(self.samples) if s.memory_blocked), len(self.samples))
        end = next((i for i in range(start, len(self.samples)) if self.samples[i].waiting == 0), None)
        return self.samples[start:end]

    @property
    def mean_running(self) -> float:
        return _mean([s.running for s in self.samples])

    @property
    def mean_running_full(self) -> float:
        return _mean([s.running for s in self.full_window])

    @property
    def utilization_full(self) -> float:
        return _mean([self.utilization(s) for s in self.full_window if s.used_blocks])

    @property
    def mean_utilization(self) -> float:
        return _mean([self.utilization(s) for s in self.samples if s.used_blocks])

    @property
    def throughput(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else math.nan

    @property
    def ttft_mean(self) -> float:
        return _mean(self.ttft)

    @property
    def ttft_p99(self) -> float:
        return float(np.percentile(self.ttft, 99)) if self.ttft else math.nan

    @property
    def blocks_returned(self) -> bool:
        return self.blocks_used_after == 0 and self.seqs_after == 0

    def figures(self) -> dict[str, float | int | bool]:
        return {
            "peak_running": self.peak_running,
            "mean_running_full": self.mean_running_full,
            "mean_running": self.mean_running,
            "utilization_full": self.utilization_full,
            "mean_utilization": self.mean_utilization,
            "generated_tokens": self.generated_tokens,
            "throughput_tokens_per_s": self.throughput,
            "ttft_mean_s": self.ttft_mean,
            "ttft_p99_s": self.ttft_p99,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "steps": self.steps,
            "full_window_steps": len(self.full_window),
            "wall_s": self.wall_s,
            "blocks_used_after": self.blocks_used_after,
            "blocks_total": self.total_blocks,
            "blocks_returned": self.blocks_returned,
        }


def _mean(values: list[float] | list[int]) -> float:
    return float(np.mean(values)) if values else math.nan


@dataclass
class CapacityResult:
    config: CapacityConfig
    runs: dict[str, PolicyRun]
    #: The simulator's concurrent requests per policy at full scale (mean of SIM_DRAWS snapshots).
    predicted: dict[str, float]
    #: The closed-form expectation once full, from the run's own requests, length-biased.
    length_biased: dict[str, float]
    plots: list[Path] = field(default_factory=list)

    def ratio(self, figure: str, policy: KVPolicy = PAGED, baseline: KVPolicy = CONTIGUOUS) -> float:
        return getattr(self.runs[policy.name], figure) / getattr(self.runs[baseline.name], figure)

    def to_json(self) -> dict:
        return {
            "config": asdict(self.config),
            "engine": {
                "max_model_len": self.config.run_max_model_len,
                "block_size": self.config.run_block_size,
                "num_kv_blocks": self.config.num_kv_blocks,
            },
            "policies": {name: run.figures() for name, run in self.runs.items()},
            "simulator_predicted_running": self.predicted,
            "length_biased_predicted_running": self.length_biased,
            "plots": [str(p) for p in self.plots],
        }


class _PolicyDriver:
    """One engine under one policy: steps it on its own clock and samples its state."""

    def __init__(self, policy: KVPolicy, config: CapacityConfig) -> None:
        self.policy = policy.name
        from pagedkv.engine import LLMEngine

        self.engine = LLMEngine(config.engine_config(policy))
        self.clock = 0.0
        self.samples: list[StepSample] = []
        self.first_token: dict[str, float] = {}

    def submit(self, requests: list[tuple[list[int], int]]) -> None:
        from pagedkv.engine import SamplingParams

        for i, (prompt, max_tokens) in enumerate(requests):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            self.engine.add_request(f"req-{i}", prompt, params)

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> int:
        """One engine step; returns how many requests finished in it."""
        outputs = self.engine.step()
        stats = self.engine.last_step
        self.clock += stats.step_time_s
        for out in outputs:  # a request's first output carries its first token
            self.first_token.setdefault(out.request_id, self.clock)
        self.samples.append(
            StepSample(
                elapsed=self.clock,
                running=stats.running,
                waiting=stats.waiting,
                used_blocks=stats.kv_blocks_used,
                stored_tokens=stats.kv_tokens_stored,
                memory_blocked=stats.admission_blocked_by_kv,
            )
        )
        return stats.finished_requests

    def result(self) -> PolicyRun:
        stats = self.engine.stats()
        return PolicyRun(
            policy=self.policy,
            block_size=stats.kv.block_size,
            total_blocks=stats.kv.total_blocks,
            samples=self.samples,
            ttft=list(self.first_token.values()),
            generated_tokens=stats.generated_tokens,
            preemptions=stats.preemptions,
            recomputed_tokens=stats.dropped_tokens - stats.prefix_cache_hits,
            blocks_used_after=stats.kv.used_blocks,
            seqs_after=stats.kv_sequences,
        )


@contextlib.contextmanager
def _run_settings(threads: int | None) -> Iterator[None]:
    """Silence the scheduler's warning at every preemption (the run counts them instead) and
    use ``threads`` torch threads; both restored afterwards."""
    import torch

    logger = logging.getLogger("pagedkv.scheduler")
    level, num_threads = logger.level, torch.get_num_threads()
    logger.setLevel(logging.ERROR)
    torch.set_num_threads(threads or num_threads)
    try:
        yield
    finally:
        logger.setLevel(level)
        torch.set_num_threads(num_threads)


def simulator_prediction(config: CapacityConfig, draws: int = SIM_DRAWS) -> dict[str, float]:
    """Concurrent requests per policy that the simulator predicts for this workload and budget.

    Its ``capacity`` experiment fills the budget with requests at uniformly random progress (the
    steady state of a busy server) until one does not fit; the mean of ``draws`` such snapshots
    at full scale (ratios do not depend on ``scale``)."""
    workload = Workload(config.workload, config.max_model_len)
    snapshots = [
        capacity(workload, config.kv_tokens, config.block_size, rng)
        for rng in np.random.default_rng(config.seed).spawn(draws)
    ]
    return {p.name: _mean([s[SIM_ALLOCATORS[p]] for s in snapshots]) for p in KV_POLICIES}


def length_biased_prediction(
    config: CapacityConfig, requests: list[tuple[list[int], int]]
) -> dict[str, float]:
    """Concurrent requests per policy expected once the batch is full, in closed form.

    In a full batch a request keeps its place for as many steps as it generates tokens, so the
    running set is a length-biased sample of the workload: a request is found there in proportion
    to its ``max_tokens``, where the simulator's snapshot takes every request equally. The KV a
    policy holds for a request, averaged over its decode steps and weighted so, is the mean held
    per running request; the budget divided by it is the expected count."""
    bs = config.run_block_size
    held = dict.fromkeys(KV_POLICIES, 0)
    steps = 0
    for prompt_ids, output in requests:
        prompt = len(prompt_ids)
        stored = prompt + np.arange(output)  # tokens held at each of its decode steps
        for policy in KV_POLICIES:
            reserved = policy.reserved_tokens(prompt, output, config.run_max_model_len)
            held[policy] += int((-(-np.maximum(stored, reserved) // bs)).sum()) * bs
        steps += output
    budget = config.num_kv_blocks * bs
    return {policy.name: budget * steps / held[policy] for policy in KV_POLICIES}


def _warm_up(config: CapacityConfig) -> None:
    """Pay the one-time costs (loading the attention kernel, first-call allocations) on a
    throwaway engine, so they fall on no policy's clock. The prompt is long enough to take the
    prefill path, and the request decodes a few tokens."""
    from pagedkv.engine import LLMEngine, SamplingParams

    engine = LLMEngine(config.engine_config(PAGED))
    prompt = list(range(min(64, config.run_max_model_len // 2)))
    engine.add_request("warm-up", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_capacity(config: CapacityConfig, progress: bool = False) -> CapacityResult:
    """Run the workload under every KV policy, interleaved step by step, and measure each."""
    with _run_settings(config.threads):
        _warm_up(config)
        drivers = [_PolicyDriver(policy, config) for policy in KV_POLICIES]
        requests = config.requests(drivers[0].engine.model_config.vocab_size)
        for driver in drivers:
            driver.submit(requests)
        with tqdm(
            total=len(requests) * len(drivers), desc="capacity", unit="req", disable=not progress
        ) as bar:
            active = drivers
            while active:
                for driver in active:
                    bar.update(driver.step())
                active = [d for d in active if not d.done]
    runs = {d.policy: d.result() for d in drivers}
    return CapacityResult(
        config, runs, simulator_prediction(config), length_biased_prediction(config, requests)
    )


# -- report --------------------------------------------------------------------------------------
def _ratio(value: float) -> str:
    return f"{value:.2f}x" if math.isfinite(value) else "-"


def _show(fmt: str, value: float) -> str:
    """A figure, or "-" where it does not exist (a policy whose batch never filled memory)."""
    return fmt.format(value) if math.isfinite(value) else "-"


def print_capacity(result: CapacityResult, console: Console) -> None:
    """The figures table, the simulator comparison and the issue's targets."""
    config, runs = result.config, result.runs
    console.print(
        f"[bold]KV capacity[/]: {config.num_requests} '{config.workload}' requests (seed {config.seed}) "
        f"submitted at once; KV budget {config.num_kv_blocks} blocks x {config.run_block_size} tokens, "
        f"max_model_len {config.run_max_model_len}"
        + (f" (every length / {config.scale})" if config.scale > 1 else "")
        + ". 'running' = requests running at once; 'KV use' = token slots holding a token / slots held. "
        "Averages are per engine step; times are each policy's own clock."
    )
    table = Table(title="paged vs contiguous reservation, same model, pool and kernels")
    table.add_column("figure")
    for policy in KV_POLICIES:
        table.add_column(policy.name, justify="right")
    table.add_column("paged/contig.", justify="right")
    rows = [
        ("running, peak", "peak_running", "{:.0f}", True),
        ("running, mean once full", "mean_running_full", "{:.1f}", True),
        ("running, mean over the run", "mean_running", "{:.1f}", True),
        ("KV use once full", "utilization_full", "{:.1%}", True),
        ("KV use over the run", "mean_utilization", "{:.1%}", True),
        ("generated tokens/s", "throughput", "{:.0f}", True),
        ("TTFT mean (s)", "ttft_mean", "{:.2f}", False),
        ("TTFT p99 (s)", "ttft_p99", "{:.2f}", False),
        ("preemptions", "preemptions", "{}", False),
        ("tokens recomputed after preemption", "recomputed_tokens", "{}", False),
        ("engine steps", "steps", "{}", False),
        ("wall time (s)", "wall_s", "{:.1f}", False),
    ]
    for label, key, fmt, with_ratio in rows:
        values = [getattr(runs[p.name], key) for p in KV_POLICIES]
        ratio = _ratio(values[0] / values[1]) if with_ratio and values[1] else ""
        table.add_row(label, *(_show(fmt, v) for v in values), ratio)
    table.add_row(
        "blocks back at the end",
        *(f"{r.total_blocks - r.blocks_used_after}/{r.total_blocks}" for r in runs.values()),
        "",
    )
    console.print(table)
    _print_prediction(result, console)
    _print_targets(result, console)


def _print_prediction(result: CapacityResult, console: Console) -> None:
    table = Table(title="running requests once full: predicted vs live engine")
    for name in ("policy", "simulator", "length-biased", "measured"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    columns = (
        result.predicted,
        result.length_biased,
        {p: r.mean_running_full for p, r in result.runs.items()},
    )
    for policy in KV_POLICIES:
        table.add_row(policy.name, *(_show("{:.1f}", figures[policy.name]) for figures in columns))
    table.add_row("paged/contig.", *(_ratio(f[PAGED.name] / f[CONTIGUOUS.name]) for f in columns))
    console.print(table)
    console.print(
        "simulator: requests at uniformly random progress, each equally likely (its capacity "
        "experiment, full scale). length-biased: the same in closed form from this run's requests, "
        "each weighted by its output length, as a full batch holds them."
    )


def _print_targets(result: CapacityResult, console: Console) -> None:
    paged = result.runs[PAGED.name]
    checks = [
        (
            "paged >= 2x contiguous concurrent requests (mean once full)",
            result.ratio("mean_running_full"),
            2.0,
        ),
        ("paged >= 2x contiguous concurrent requests (peak)", result.ratio("peak_running"), 2.0),
        ("paged >= 1.5x contiguous throughput", result.ratio("throughput"), 1.5),
        ("paged KV utilization >= 95% once full", paged.utilization_full, 0.95),
    ]
    for label, value, target in checks:
        if not math.isfinite(value):
            never = [name for name, run in result.runs.items() if not run.full_window]
            console.print(
                f"  [yellow]n/a[/]  {label}: {' and '.join(never)} never filled the KV budget (add requests)"
            )
            continue
        mark = "[green]met[/]" if value >= target else "[red]NOT met[/]"
        console.print(f"  {mark}  {label}: {value:.2f}")
    back = all(run.blocks_returned for run in result.runs.values())
    console.print(f"  {'[green]met[/]' if back else '[red]NOT met[/]'}  every block back in the pool")


# -- command line --------------------------------------------------------------------------------
def add_bench_capacity_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``capacity`` under ``pagedkv bench``."""
    parser = bench_subparsers.add_parser(
        "capacity",
        help="paged vs contiguous KV reservation in the live engine: concurrency, utilization, throughput",
        description="Run one seeded workload, all requests at once, under the paged, contiguous "
        "(max_model_len reserved per request) and contiguous-oracle (prompt + max_tokens) KV policies "
        "on the same model and KV budget, interleaved step by step; print the figures next to the "
        "simulator's prediction and write plots.",
    )
    run = parser.add_argument_group("workload and budget")
    run.add_argument(
        "--workload", choices=WORKLOADS, default="normal", help="length mix (default: %(default)s)"
    )
    run.add_argument("--num-requests", type=int, default=128, help="requests (default: %(default)s)")
    run.add_argument(
        "--kv-tokens", type=int, default=16 * 2048, help="KV budget in tokens (default: %(default)s)"
    )
    run.add_argument("--max-model-len", type=int, default=2048, help="context length (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    run.add_argument(
        "--scale",
        type=int,
        default=1,
        help="divide every length, the budget and the block size by this, for a quick run (default: 1)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=None, help="HF model folder (default: the built-in tiny Llama)")
    engine.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    engine.add_argument(
        "--max-num-seqs", type=int, default=256, help="running sequences per step (default: 256)"
    )
    engine.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default: 2048)"
    )
    engine.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="disable prefix caching",
    )
    engine.add_argument("--attention-backend", default=None, help="torch, cpu or triton (default: by device)")
    engine.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    add_report_options(parser)
    parser.set_defaults(run=_run_bench_capacity, parser=parser)
    return parser


def _run_bench_capacity(args: argparse.Namespace) -> int:
    try:
        config = CapacityConfig(
            workload=args.workload,
            num_requests=args.num_requests,
            kv_tokens=args.kv_tokens,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            scale=args.scale,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            model=args.model,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            threads=args.threads,
        )
    except ValueError as err:
        args.parser.error(str(err))
    result = run_capacity(config, progress=sys.stderr.isatty())
    if not args.no_plots:
        _write_plots(result, args.out)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        console = Console()
        print_capacity(result, console)
        _print_plot_paths(result, console)
    return 0 if all(run.blocks_returned for run in result.runs.values()) else 1


def _write_plots(result: CapacityResult, out: Path) -> None:
    from pagedkv.bench.capacity_plots import write_capacity_plots  # matplotlib: only when plotting

    result.plots = write_capacity_plots(result, out)


def _print_plot_paths(result: CapacityResult, console: Console) -> None:
    for path in result.plots:
        console.print(f"  plot: {path}")


def run_capacity_demo(console: Console, out_dir: str | Path, seed: int = 0) -> CapacityResult:
    """The ``pagedkv demo`` section: the benchmark at 1/8 scale with half the budget (~10 s on 2
    cores). One torch thread: a tiny model's steps gain little from a second one, and lose a lot
    when the machine is busy with anything else."""
    config = CapacityConfig(num_requests=64, kv_tokens=8 * 2048, scale=8, seed=seed, threads=1)
    result = run_capacity(config, progress=sys.stderr.isatty())
    _write_plots(result, Path(out_dir))
    print_capacity(result, console)
    _print_plot_paths(result, console)
    return result
