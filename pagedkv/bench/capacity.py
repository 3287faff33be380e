"""``pagedkv bench capacity``: how many requests one KV budget serves at once, per KV policy.

One seeded workload (the simulator's length mixes) runs through three live engines that differ
only in their KV policy -- ``paged`` (blocks on demand), ``contiguous`` (``max_model_len`` slots
reserved per request at admission: the systems PagedAttention replaced) and
``contiguous-oracle`` (exactly prompt + ``max_tokens``) -- on the same model, pool size and
kernels, all without a prefix cache (which only the paged policy could have). Every request is
submitted at time 0 (an offline batch): a closed system, which is what "how many fit" measures.
The engines are stepped in turn, each on its own clock; a request's time to first token is its
engine's clock when that token came out.

Averages over time are per engine step (each step counts once), so they are reproducible;
throughput and latencies use the engines' clocks. "Once the batch is full" is the window from
the first step after which the next waiting request did not fit in free KV memory to the first
step after which nothing waits. The figures are set next to two predictions: the simulator's
capacity experiment, and a closed form from the run's own requests. Tables and plots:
:mod:`pagedkv.bench.capacity_report`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property

import numpy as np

from pagedkv.bench.driver import EngineOptions, MeasuredEngine, mean, progress, run_settings, step_in_turn
from pagedkv.bench.hybrid_capacity import HybridCapacityConfig, HybridCapacityResult, run_hybrid_capacity
from pagedkv.bench.options import check_options, option
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.core.kv_policy import CONTIGUOUS, CONTIGUOUS_ORACLE, KV_POLICIES, PAGED, KVPolicy
from pagedkv.sim.experiments import capacity
from pagedkv.sim.workloads import Workload

#: Workloads without shared prefixes: with sharing, "tokens stored" would count a block twice.
WORKLOADS = ("normal", "sharegpt")
#: The sequence budget of the capacity runs: high enough that the KV pool, not the number of
#: sequences per step, is what limits how many requests run at once.
CAPACITY_MAX_NUM_SEQS = 256
#: The simulator's allocator that models each engine policy, and how many of its random
#: snapshots one prediction averages.
SIM_ALLOCATORS = {PAGED: "paged", CONTIGUOUS: "max", CONTIGUOUS_ORACLE: "oracle"}
SIM_DRAWS = 16


@dataclass(frozen=True)
class CapacityConfig:
    """The run. The engine options' ``scale`` divides every length -- prompts, outputs,
    ``max_model_len``, the KV budget, the block size and the per-step token budget -- so a scaled
    run keeps the shape of the full one with ``scale`` times fewer tokens."""

    workload: str = option("normal", "length mix", choices=WORKLOADS)
    num_requests: int = option(128, "requests", positive=True)
    kv_tokens: int = option(16 * 2048, "KV budget in tokens", positive=True)
    max_model_len: int = option(2048, "context length", positive=True)
    seed: int = option(0, "random seed")
    hybrid: bool = option(
        False,
        "instead: sequences one KV budget holds with hybrid paging on and off, for --model's layer kinds "
        "and window (without it, Gemma 2's and 3's); the capacity-hybrid command takes its other options",
    )
    #: every policy's schedule is the same in each run, so each step's time is taken as its least
    #: over the runs (what a burst of other work did not disturb)
    repeats: int = option(1, "runs of the workload; each step is timed by its fastest run", positive=True)
    engine: EngineOptions = field(default_factory=lambda: EngineOptions(max_num_seqs=CAPACITY_MAX_NUM_SEQS))

    def __post_init__(self) -> None:
        check_options(self)
        for name, value in (
            ("max_model_len", self.max_model_len),
            ("kv_tokens", self.kv_tokens),
            ("max_num_batched_tokens", self.engine.max_num_batched_tokens),
        ):
            if value % self.scale:
                raise ValueError(f"scale {self.scale} must divide {name} ({value})")
        if self.run_max_model_len < 2:
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
    def scale(self) -> int:
        return self.engine.scale

    @property
    def run_max_model_len(self) -> int:
        return self.max_model_len // self.scale

    @property
    def run_block_size(self) -> int:
        return self.engine.run_block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_tokens // self.scale // self.run_block_size

    def engine_config(self, policy: KVPolicy) -> EngineConfig:
        """The same budget for every policy (no watermark). No prefix cache either: the
        contiguous policies cannot have one and these workloads share no prefix, so it would
        cost the paged engine alone; ``pagedkv bench sharing`` measures it."""
        return self.engine.engine_config(
            self.num_kv_blocks, self.run_max_model_len, enable_prefix_caching=False, kv_policy=policy
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
    #: Tokens the forward passes computed, prompts, decodes and recomputation alike.
    computed_tokens: int
    blocks_used_after: int
    seqs_after: int

    def utilization(self, sample: StepSample) -> float:
        return sample.stored_tokens / (sample.used_blocks * self.block_size)

    @property
    def full_window(self) -> list[StepSample]:
        """Steps from the first one after which memory blocked admission, until nothing waits."""
        start = next((i for i, s in enumerate(self.samples) if s.memory_blocked), len(self.samples))
        end = next((i for i in range(start, len(self.samples)) if self.samples[i].waiting == 0), None)
        return self.samples[start:end]

    @property
    def blocks_returned(self) -> bool:
        return self.blocks_used_after == 0 and self.seqs_after == 0

    @cached_property
    def figures(self) -> dict[str, float | int | bool]:
        """Every figure of the run by name: its JSON and its tables.

        All but the timed ones (throughput, step time, TTFT, wall time) are counts: the scheduler
        decides from token and block counts alone, so for a given workload and configuration they
        are the same on every host, whatever its CPU or load."""
        samples, full = self.samples, self.full_window
        wall = samples[-1].elapsed if samples else 0.0
        utilization_full = mean([self.utilization(s) for s in full if s.used_blocks])
        return {
            "peak_running": max((s.running for s in samples), default=0),
            "mean_running_full": mean([s.running for s in full]),
            "mean_running": mean([s.running for s in samples]),
            "utilization_full": utilization_full,
            # held slots without a token: reserved ahead of the tokens, or a last block's tail
            "empty_share_full": 1.0 - utilization_full,
            "mean_utilization": mean([self.utilization(s) for s in samples if s.used_blocks]),
            "generated_tokens": self.generated_tokens,
            "tokens_per_step": self.generated_tokens / len(samples) if samples else math.nan,
            "throughput_tokens_per_s": self.generated_tokens / wall if wall else math.nan,
            "step_time_mean_ms": 1000 * wall / len(samples) if samples else math.nan,
            "ttft_mean_s": mean(self.ttft),
            "ttft_p99_s": float(np.percentile(self.ttft, 99)) if self.ttft else math.nan,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
            "computed_tokens": self.computed_tokens,
            # the share of the computed tokens that only made up for preemption: work thrown away
            "recomputed_share": self.recomputed_tokens / self.computed_tokens
            if self.computed_tokens
            else 0.0,
            "steps": len(samples),
            "full_window_steps": len(full),
            "wall_s": wall,
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

    @property
    def ok(self) -> bool:
        return all(run.blocks_returned for run in self.runs.values())

    def ratio(self, figure: str, policy: KVPolicy = PAGED, baseline: KVPolicy = CONTIGUOUS) -> float:
        return self.runs[policy.name].figures[figure] / self.runs[baseline.name].figures[figure]

    def to_json(self) -> dict:
        return {
            "config": asdict(self.config),
            "engine": {
                "max_model_len": self.config.run_max_model_len,
                "block_size": self.config.run_block_size,
                "num_kv_blocks": self.config.num_kv_blocks,
            },
            "policies": {name: run.figures for name, run in self.runs.items()},
            "simulator_predicted_running": self.predicted,
            "length_biased_predicted_running": self.length_biased,
        }


def simulator_prediction(config: CapacityConfig, draws: int = SIM_DRAWS) -> dict[str, float]:
    """Concurrent requests per policy that the simulator predicts for this workload and budget.

    Its ``capacity`` experiment fills the budget with requests at uniformly random progress (the
    steady state of a busy server) until one does not fit; the mean of ``draws`` such snapshots
    at full scale (ratios do not depend on ``scale``)."""
    workload = Workload(config.workload, config.max_model_len)
    snapshots = [
        capacity(workload, config.kv_tokens, config.engine.block_size, rng)
        for rng in np.random.default_rng(config.seed).spawn(draws)
    ]
    return {p.name: mean([s[SIM_ALLOCATORS[p]] for s in snapshots]) for p in KV_POLICIES}


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
        stored = len(prompt_ids) + np.arange(output)  # tokens held at each of its decode steps
        for policy in KV_POLICIES:
            reserved = policy.reserved_tokens(len(prompt_ids), output, config.run_max_model_len)
            held[policy] += int((-(-np.maximum(stored, reserved) // bs)).sum()) * bs
        steps += output
    budget = config.num_kv_blocks * bs
    return {policy.name: budget * steps / held[policy] for policy in KV_POLICIES}


def least_clocks(policy: KVPolicy, repeats: list[MeasuredEngine]) -> list[float]:
    """The clock after each step, each step timed by the least of its repeats.

    Every repeat runs the same requests on a fresh engine of the same policy: the same schedule,
    step for step (checked here), so a step's fastest time is its cost without the bursts of
    other work that a shared machine lands on one engine or another.
    """
    if len({tuple(step.num_tokens for step in run.steps) for run in repeats}) != 1:
        raise RuntimeError(
            f"the {policy} engine scheduled the same requests differently from one repeat to the next"
        )
    times = [
        min(steps) for steps in zip(*([s.step_time_s for s in run.steps] for run in repeats), strict=True)
    ]
    return list(itertools.accumulate(times))


def _policy_run(policy: KVPolicy, repeats: list[MeasuredEngine]) -> PolicyRun:
    """One policy's figures from its engines' statistics records, each step timed by its fastest repeat."""
    measured, clocks = repeats[0], least_clocks(policy, repeats)
    samples = [
        StepSample(
            clock, s.running, s.waiting, s.kv_blocks_used, s.kv_tokens_stored, s.admission_blocked_by_kv
        )
        for s, clock in zip(measured.steps, clocks, strict=True)
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


def run_capacity(config: CapacityConfig) -> CapacityResult | HybridCapacityResult:
    """Run the workload under every KV policy, interleaved step by step, ``config.repeats``
    times on fresh engines, after a warm-up engine has paid the one-time costs (the kernels'
    loading, first-call allocations) that would otherwise fall on one policy's clock. With
    ``hybrid``: :func:`~pagedkv.bench.hybrid_capacity.run_hybrid_capacity` for the model."""
    from pagedkv.engine import SamplingParams

    if config.hybrid:
        return run_hybrid_capacity(HybridCapacityConfig(model=config.engine.model))

    with run_settings(config.engine.threads):
        warm = MeasuredEngine.start(config.engine_config(PAGED), prime=False)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        warm.submit("warm-up", list(range(min(64, config.run_max_model_len // 2))), params)
        warm.drain()
        requests = config.requests(warm.engine.model_config.vocab_size)
        repeats = []
        for r in range(config.repeats):
            progress(f"capacity: run {r + 1} of {config.repeats}, {len(requests)} requests per policy")
            engines = [MeasuredEngine.start(config.engine_config(p), prime=False) for p in KV_POLICIES]
            for measured in engines:
                for i, (prompt, max_tokens) in enumerate(requests):
                    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                    measured.submit(f"req-{i}", prompt, params)
            step_in_turn(engines)
            repeats.append(engines)
            if r > 0:  # of the later runs only the step records are read
                for measured in engines:
                    measured.engine.shutdown()
    runs = {p.name: _policy_run(p, [r[i] for r in repeats]) for i, p in enumerate(KV_POLICIES)}
    return CapacityResult(
        config, runs, simulator_prediction(config), length_biased_prediction(config, requests)
    )


def demo_config(seed: int = 0) -> CapacityConfig:
    """The ``pagedkv demo`` section: the benchmark at 1/8 scale with half the budget, on one
    torch thread (a tiny model's steps gain little from a second one and lose a lot when the
    machine is busy with anything else). Its claims are counts; the three runs steady only the
    timed figures shown beside them."""
    engine = EngineOptions(max_num_seqs=CAPACITY_MAX_NUM_SEQS, scale=8, threads=1)
    return CapacityConfig(num_requests=64, kv_tokens=8 * 2048, seed=seed, engine=engine, repeats=3)
