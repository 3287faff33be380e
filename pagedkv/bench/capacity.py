"""``pagedkv bench capacity``: how many requests one KV budget serves at once, per KV policy.

One seeded workload (the simulator's length mixes) runs through three live engines that differ
only in their KV policy -- ``paged`` (blocks on demand), ``contiguous`` (``max_model_len`` slots
reserved per request at admission: the systems PagedAttention replaced) and
``contiguous-oracle`` (exactly prompt + ``max_tokens``) -- on the same model, pool size and
kernels, all without a prefix cache (which only the paged policy could have). Every request is
submitted at time 0 (an offline batch): a closed system, which is what "how many fit" measures.

The engines are stepped in turn, one step each, and every policy keeps its own clock (see
:mod:`pagedkv.bench.driver`); a request's time to first token is its engine's clock when that
token came out, since every request arrived at 0.

Averages over time are per engine step (each step counts once), so they are reproducible;
throughput and latencies use wall time. "Once the batch is full" is the window from the first
step after which the next waiting request did not fit in free KV memory to the first step after
which nothing waits.

The run's configuration is in :mod:`~pagedkv.bench.capacity_config`, the predictions it is
compared with in :mod:`~pagedkv.bench.capacity_prediction`, its tables, plots and command line
in ``capacity_report``, ``capacity_plots`` and ``capacity_cli``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from pagedkv.bench.capacity_config import CapacityConfig
from pagedkv.bench.capacity_prediction import length_biased_prediction, simulator_prediction
from pagedkv.bench.driver import MeasuredEngine, mean, run_settings, step_in_turn
from pagedkv.engine.kv_policy import CONTIGUOUS, KV_POLICIES, PAGED, KVPolicy


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
    #: Tokens the forward passes computed, prompts, decodes and recomputation alike.
    computed_tokens: int
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
        return mean([s.running for s in self.samples])

    @property
    def mean_running_full(self) -> float:
        return mean([s.running for s in self.full_window])

    @property
    def utilization_full(self) -> float:
        return mean([self.utilization(s) for s in self.full_window if s.used_blocks])

    @property
    def mean_utilization(self) -> float:
        return mean([self.utilization(s) for s in self.samples if s.used_blocks])

    @property
    def throughput(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else math.nan

    @property
    def recomputed_share(self) -> float:
        """Share of the computed tokens that only made up for preemption: work thrown away."""
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0

    @property
    def ttft_mean(self) -> float:
        return mean(self.ttft)

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
            "computed_tokens": self.computed_tokens,
            "recomputed_share": self.recomputed_share,
            "steps": self.steps,
            "full_window_steps": len(self.full_window),
            "wall_s": self.wall_s,
            "blocks_used_after": self.blocks_used_after,
            "blocks_total": self.total_blocks,
            "blocks_returned": self.blocks_returned,
        }


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


def _policy_run(policy: KVPolicy, repeats: list[MeasuredEngine]) -> PolicyRun:
    """The figures of one policy's engine, from its statistics records; with several repeats of
    the same schedule, each step timed by its fastest repeat (:func:`least_clocks`)."""
    measured = repeats[0]
    clocks = least_clocks(policy, repeats)
    samples = [
        StepSample(
            elapsed=clock,
            running=step.running,
            waiting=step.waiting,
            used_blocks=step.kv_blocks_used,
            stored_tokens=step.kv_tokens_stored,
            memory_blocked=step.admission_blocked_by_kv,
        )
        for step, clock in zip(measured.steps, clocks, strict=True)
    ]
    totals = measured.engine.stats()
    return PolicyRun(
        policy=policy.name,
        block_size=totals.kv.block_size,
        total_blocks=totals.kv.total_blocks,
        samples=samples,
        ttft=[clocks[step] for step in measured.first_token_step.values()],
        generated_tokens=totals.generated_tokens,
        preemptions=totals.preemptions,
        recomputed_tokens=totals.dropped_tokens - totals.prefix_cache_hits,
        computed_tokens=sum(step.num_tokens for step in measured.steps),
        blocks_used_after=totals.kv.used_blocks,
        seqs_after=totals.kv_sequences,
    )


def least_clocks(policy: KVPolicy, repeats: list[MeasuredEngine]) -> list[float]:
    """The clock after each step, each step timed by the least of its repeats.

    Every repeat runs the same requests on a fresh engine of the same policy: the same schedule,
    step for step (checked here), so a step's fastest time is its cost without the bursts of
    other work that a shared machine lands on one engine or another. One run of the demo's
    workload takes under a second per policy, and such a burst moved its ratios by 0.1-0.3.
    """
    schedules = {tuple(step.num_tokens for step in run.steps) for run in repeats}
    if len(schedules) != 1:
        raise RuntimeError(
            f"the {policy} engine scheduled the same requests differently from one repeat to the next"
        )
    times = [
        min(steps) for steps in zip(*([s.step_time_s for s in run.steps] for run in repeats), strict=True)
    ]
    return list(itertools.accumulate(times))


def _warm_up(config: CapacityConfig) -> None:
    """Pay the one-time costs (loading the attention kernel, first-call allocations) on a
    throwaway engine, so they fall on no policy's clock. The prompt is long enough to take the
    prefill path, and the request decodes a few tokens."""
    from pagedkv.engine import SamplingParams

    warm = MeasuredEngine.start(config.engine_config(PAGED), prime=False)
    prompt = list(range(min(64, config.run_max_model_len // 2)))
    warm.submit("warm-up", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    warm.drain()


def run_capacity(config: CapacityConfig, progress: bool = False) -> CapacityResult:
    """Run the workload under every KV policy, interleaved step by step, ``config.repeats``
    times on fresh engines, and measure each."""
    with run_settings(config.engine.threads):
        _warm_up(config)
        total = config.num_requests * len(KV_POLICIES) * config.repeats
        with tqdm(total=total, desc="capacity", unit="req", disable=not progress) as bar:
            repeats = [_run_once(config, bar, keep=r == 0) for r in range(config.repeats)]
    requests = config.requests(repeats[0][0].engine.model_config.vocab_size)
    runs = {p.name: _policy_run(p, [r[i] for r in repeats]) for i, p in enumerate(KV_POLICIES)}
    return CapacityResult(
        config, runs, simulator_prediction(config), length_biased_prediction(config, requests)
    )


def _run_once(config: CapacityConfig, bar: tqdm, keep: bool) -> list[MeasuredEngine]:
    """The workload through a fresh engine per policy, stepped in turn; the engines, in policy
    order (unless ``keep``, shut down once done: only their step records are read)."""
    from pagedkv.engine import SamplingParams

    engines = [MeasuredEngine.start(config.engine_config(p), prime=False) for p in KV_POLICIES]
    requests = config.requests(engines[0].engine.model_config.vocab_size)
    for measured in engines:
        for i, (prompt, max_tokens) in enumerate(requests):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            measured.submit(f"req-{i}", prompt, params)
    for outputs in step_in_turn(engines):
        bar.update(sum(out.finished for out in outputs))
    if not keep:
        for measured in engines:
            measured.engine.shutdown()
    return engines
