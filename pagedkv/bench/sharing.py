"""``pagedkv bench sharing``: the KV memory that block sharing saves, measured in the live engine.

Two experiments on the same model and kernels:

* **Shared system prompt.** ``N`` requests = one common ``S``-token prefix + a unique user part,
  all submitted at once, through two engines that differ only in prefix caching. The engines are
  stepped in turn and each keeps its own clock (:mod:`pagedkv.bench.driver`), so background
  load hits both alike; every request arrives at its engine's clock when submitted, so time to
  first token (TTFT) is that clock when the token came out minus the arrival. Greedy outputs must
  be identical with caching on and off. With every request submitted at once, the requests that
  fit in the first step's token budget all compute the prefix: the engine offers a block to other
  requests only once a step has computed it (vLLM v1 registers full blocks when it schedules
  them, so its later requests in the same step already hit). ``warm`` sends one request with the
  same system prompt first: the steady state of a server that has seen the prompt before.
* **Parallel sampling and beam search.** A batch of prompts with an Alpaca-like (or ShareGPT-like)
  length mix, each decoded as ``n`` samples or ``beam_width`` beams. The samples and beams of a
  request fork one block table (copy-on-write); "without sharing" is what the same sequences
  would hold if each had a private copy of every block in its table.

KV use is what each step's statistics record (``StepStats``) says the forward pass held -- after
the scheduler allocated the step's slots and copy-on-write blocks, before anything was freed or
deduplicated: the memory the step really needs. Averages over time are per engine step (a
forward pass counts once), so they are reproducible. The experiments' configurations are in
:mod:`~pagedkv.bench.sharing_config`; tables, plots and the command line in ``sharing_report``,
``sharing_plots`` and ``sharing_cli``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from pagedkv.bench.driver import EngineOptions, MeasuredEngine, mean, run_settings, step_in_turn
from pagedkv.bench.sharing_config import FORK_KINDS, PAPER_SAVING, ForkConfig, PrefixConfig
from pagedkv.engine import BeamSearchParams, SamplingParams
from pagedkv.memory import blocks_for


@dataclass(frozen=True)
class KVSample:
    """The KV cache while one forward pass ran."""

    used_blocks: int  # physical blocks held (a shared block counts once)
    table_blocks: int  # sum of the live sequences' block-table lengths: each a private copy
    prefill_tokens: int  # prompt tokens this step computed


def kv_samples(measured: MeasuredEngine, first_step: int = 0) -> list[KVSample]:
    """One sample per step of ``measured`` from ``first_step`` on, from its statistics records."""
    return [
        KVSample(s.kv_blocks_at_forward, s.kv_table_blocks_at_forward, s.prefill_tokens)
        for s in measured.steps[first_step:]
    ]


# -- shared system prompt ------------------------------------------------------------------------
@dataclass
class PrefixRun:
    """One engine's figures for the measured requests (a warm-up request excluded)."""

    caching: bool
    samples: list[KVSample]
    prompt_tokens: int
    prefix_hit_tokens: int
    ttft: list[float]
    outputs: dict[str, list[list[int]]]
    #: Per request, prompt tokens served from the prefix cache at admission.
    cached_tokens: list[int]
    preemptions: int
    blocks_used_after: int

    @property
    def peak_blocks(self) -> int:
        return max((s.used_blocks for s in self.samples), default=0)

    @property
    def mean_blocks(self) -> float:
        return mean([s.used_blocks for s in self.samples])

    @property
    def prefill_computed(self) -> int:
        return sum(s.prefill_tokens for s in self.samples)

    @property
    def prefill_skipped(self) -> int:
        return self.prompt_tokens - self.prefill_computed

    @property
    def ttft_mean(self) -> float:
        return mean(self.ttft)

    def figures(self) -> dict[str, float | int]:
        return {
            "peak_blocks": self.peak_blocks,
            "mean_blocks": self.mean_blocks,
            "prompt_tokens": self.prompt_tokens,
            "prefill_computed": self.prefill_computed,
            "prefill_skipped": self.prefill_skipped,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "ttft_mean_s": self.ttft_mean,
            "steps": len(self.samples),
            "preemptions": self.preemptions,
            "blocks_used_after": self.blocks_used_after,
        }


@dataclass
class PrefixPoint:
    """One (prefix length, request count): prefix caching on vs off."""

    prefix_len: int
    num_requests: int
    user_len: int
    output_len: int
    block_size: int
    on: PrefixRun
    off: PrefixRun

    @property
    def outputs_identical(self) -> bool:
        return self.on.outputs == self.off.outputs and len(self.on.outputs) == self.num_requests

    @property
    def blocks_saved(self) -> float:
        """Peak KV blocks saved by prefix caching."""
        return 1 - self.on.peak_blocks / self.off.peak_blocks

    @property
    def cold_requests(self) -> int:
        """Requests that computed the shared prefix themselves even with caching on."""
        shared = self.prefix_len // self.block_size * self.block_size
        return sum(cached < shared for cached in self.on.cached_tokens)

    def to_json(self) -> dict:
        return {
            "prefix_len": self.prefix_len,
            "num_requests": self.num_requests,
            "user_len": self.user_len,
            "output_len": self.output_len,
            "outputs_identical": self.outputs_identical,
            "cold_requests": self.cold_requests,
            "peak_blocks_saved": self.blocks_saved,
            "caching_on": self.on.figures(),
            "caching_off": self.off.figures(),
        }


def _prefix_run(
    driver: MeasuredEngine, ids: list[str], prompt_tokens: int, first_step: int, hits_before: int
) -> PrefixRun:
    engine = driver.engine
    stats = engine.stats()
    return PrefixRun(
        caching=engine.config.enable_prefix_caching,
        samples=kv_samples(driver, first_step),
        prompt_tokens=prompt_tokens,
        prefix_hit_tokens=stats.prefix_cache_hits - hits_before,
        ttft=driver.ttft(ids),
        outputs={r: driver.outputs[r] for r in ids},
        cached_tokens=[driver.cached_tokens[r] for r in ids],
        preemptions=stats.preemptions,
        blocks_used_after=stats.kv.used_blocks,
    )


def run_prefix_point(
    config: PrefixConfig, options: EngineOptions, prefix_len: int, num_requests: int
) -> PrefixPoint:
    """``num_requests`` requests sharing a ``prefix_len``-token prefix, caching on vs off."""
    s, user, out = config.lengths(prefix_len, options.scale)
    bs = options.run_block_size
    warm = int(config.warm)
    # Room for every request (and the warm-up) with nothing shared: no preemption either way.
    num_kv_blocks = (num_requests + warm) * blocks_for(s + user + out, bs)
    drivers = [
        MeasuredEngine.start(
            options.engine_config(num_kv_blocks, s + user + out, num_requests + warm, caching)
        )
        for caching in (True, False)
    ]
    vocab = drivers[0].engine.model_config.vocab_size
    prompts = config.prompts(s, user, num_requests + warm, vocab)
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    marks = []
    for driver in drivers:
        if warm:
            driver.submit("warm-up", prompts[-1], params)
            driver.drain()
        marks.append((len(driver.steps), driver.engine.stats().prefix_cache_hits))
    ids = [f"req-{i}" for i in range(num_requests)]
    for driver in drivers:
        for request_id, prompt in zip(ids, prompts[:num_requests], strict=True):
            driver.submit(request_id, prompt, params)
    for _ in step_in_turn(drivers):
        pass
    runs = [
        _prefix_run(driver, ids, num_requests * (s + user), *mark)
        for driver, mark in zip(drivers, marks, strict=True)
    ]
    return PrefixPoint(s, num_requests, user, out, bs, on=runs[0], off=runs[1])


def run_prefix(config: PrefixConfig, options: EngineOptions, progress: bool = False) -> list[PrefixPoint]:
    grid = [(s, n) for s in config.prefix_lens for n in config.num_requests]
    return [
        run_prefix_point(config, options, s, n)
        for s, n in tqdm(grid, desc="shared prefix", unit="point", disable=not progress)
    ]


# -- parallel sampling and beam search -----------------------------------------------------------
@dataclass
class ForkRun:
    """One decoding mode at one width over the whole batch."""

    kind: str  # "parallel" or "beam"
    width: int
    samples: list[KVSample]
    preemptions: int
    blocks_used_after: int

    @property
    def saving(self) -> float:
        """Time-averaged: 1 - block-steps held / block-steps without sharing."""
        held = sum(s.used_blocks for s in self.samples)
        unshared = sum(s.table_blocks for s in self.samples)
        return 1 - held / unshared if unshared else math.nan

    @property
    def peak_saving(self) -> float:
        """1 - peak blocks held / peak blocks without sharing."""
        peak = max((s.table_blocks for s in self.samples), default=0)
        return 1 - max(s.used_blocks for s in self.samples) / peak if peak else math.nan

    def figures(self) -> dict[str, float | int]:
        return {
            "saving": self.saving,
            "peak_saving": self.peak_saving,
            "peak_blocks": max((s.used_blocks for s in self.samples), default=0),
            "peak_blocks_without_sharing": max((s.table_blocks for s in self.samples), default=0),
            "steps": len(self.samples),
            "preemptions": self.preemptions,
            "blocks_used_after": self.blocks_used_after,
        }


def run_fork(config: ForkConfig, options: EngineOptions, kind: str, width: int) -> ForkRun:
    """Every prompt of the mix decoded as ``width`` samples or beams, all submitted at once."""
    if kind not in FORK_KINDS:
        raise ValueError(f"kind must be one of {FORK_KINDS}, got {kind!r}")
    bs = options.run_block_size
    lengths = config.lengths(options.scale)
    # Every sequence with a private copy of its whole table fits: no preemption.
    num_kv_blocks = sum(width * blocks_for(p + o, bs) for p, o in lengths) + width
    max_len = max(p + o for p, o in lengths)
    driver = MeasuredEngine.start(options.engine_config(num_kv_blocks, max_len, width * len(lengths), False))
    requests = config.requests(driver.engine.model_config.vocab_size, options.scale)
    for i, (prompt, output_len) in enumerate(requests):
        if kind == "parallel":
            params = SamplingParams(
                n=width, max_tokens=output_len, temperature=1.0, seed=config.seed + i, ignore_eos=True
            )
        else:
            params = BeamSearchParams(beam_width=width, max_tokens=output_len, ignore_eos=True)
        driver.submit(f"{kind}-{i}", prompt, params)
    driver.drain()
    stats = driver.engine.stats()
    return ForkRun(kind, width, kv_samples(driver), stats.preemptions, stats.kv.used_blocks)


def run_forks(config: ForkConfig, options: EngineOptions, progress: bool = False) -> list[ForkRun]:
    grid = [(kind, w) for kind in FORK_KINDS for w in config.widths]
    return [
        run_fork(config, options, kind, w)
        for kind, w in tqdm(grid, desc="samples and beams", unit="run", disable=not progress)
    ]


# -- the whole benchmark -------------------------------------------------------------------------
@dataclass
class SharingResult:
    options: EngineOptions
    prefix_config: PrefixConfig | None
    fork_config: ForkConfig | None
    prefix: list[PrefixPoint] = field(default_factory=list)
    forks: list[ForkRun] = field(default_factory=list)
    wall_s: float = 0.0
    plots: list[Path] = field(default_factory=list)

    def fork(self, kind: str, width: int) -> ForkRun:
        return next(r for r in self.forks if r.kind == kind and r.width == width)

    @property
    def outputs_identical(self) -> bool:
        return all(p.outputs_identical for p in self.prefix)

    @property
    def blocks_returned(self) -> bool:
        runs = [r for p in self.prefix for r in (p.on, p.off)] + self.forks
        return all(r.blocks_used_after == 0 for r in runs)

    @property
    def ok(self) -> bool:
        return self.outputs_identical and self.blocks_returned

    def to_json(self) -> dict:
        return {
            "options": asdict(self.options),
            "prefix_config": asdict(self.prefix_config) if self.prefix_config else None,
            "fork_config": asdict(self.fork_config) if self.fork_config else None,
            "shared_prefix": [p.to_json() for p in self.prefix],
            "forks": [{"kind": r.kind, "width": r.width, **r.figures()} for r in self.forks],
            "paper_saving": PAPER_SAVING,
            "outputs_identical": self.outputs_identical,
            "blocks_returned": self.blocks_returned,
            "wall_s": self.wall_s,
            "plots": [str(p) for p in self.plots],
        }


def run_sharing(
    options: EngineOptions,
    prefix_config: PrefixConfig | None,
    fork_config: ForkConfig | None,
    progress: bool = False,
) -> SharingResult:
    """Run the experiments that are given (None skips one)."""
    start = time.perf_counter()
    result = SharingResult(options, prefix_config, fork_config)
    with run_settings(options.threads):
        if prefix_config is not None:
            result.prefix = run_prefix(prefix_config, options, progress)
        if fork_config is not None:
            result.forks = run_forks(fork_config, options, progress)
    result.wall_s = time.perf_counter() - start
    return result


def parallel_saving_once_done(lengths: list[tuple[int, int]], block_size: int, width: int) -> float:
    """The saving of ``width`` parallel samples once every token is generated: they share exactly
    their prompt's full blocks (the partial last one is copied on the first write)."""
    shared = sum((width - 1) * (p // block_size) for p, _ in lengths)
    private = sum(width * blocks_for(p + o, block_size) for p, o in lengths)
    return shared / private
