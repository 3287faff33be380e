"""``pagedkv bench sharing``: the KV memory that block sharing saves, measured in the live engine.

Two experiments on the same model and kernels:

* **Shared system prompt.** ``N`` requests = one common ``S``-token prefix + a unique user part,
  all submitted at once, through two engines that differ only in prefix caching. The engines are
  stepped in turn and each keeps its own clock (the sum of its own step times), so background
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

KV use is sampled while each forward pass runs -- after the scheduler has allocated the step's
slots and copy-on-write blocks, before anything is freed or deduplicated -- by wrapping the
engine's model runner: that is the memory the step really needs. Averages over time are per
engine step (a forward pass counts once), so they are reproducible.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from pagedkv.bench import FORK_KINDS, MIXES
from pagedkv.engine import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from pagedkv.memory import blocks_for
from pagedkv.sim.workloads import Workload

#: First token id drawn for prompts: ids below it are the built-in tokenizer's special tokens.
FIRST_TOKEN_ID = 4
#: Means of the PagedAttention paper's Alpaca trace (Fig. 11: ShareGPT has 8.4x longer prompts
#: and 5.8x longer outputs, 161 and 338 tokens on average). Log-normal spreads are our choice.
ALPACA_PROMPT_MEAN, ALPACA_OUTPUT_MEAN, ALPACA_SIGMA = 19.3, 58.5, 0.5
#: Memory saved by sharing in the paper (Fig. 15 and Sec. 6.3), OPT-13B, widths 2, 4 and 6.
PAPER_SAVING = {
    "alpaca": {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)},
    "sharegpt": {"parallel": (0.162, 0.305), "beam": (0.443, 0.663)},
}


# -- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineOptions:
    """What every engine of the benchmark shares. ``scale`` divides the block size and the
    per-step token budget, as the experiments' configs divide their lengths."""

    model: str | None = None
    dtype: str = "float32"
    attention_backend: str | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    scale: int = 1

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "scale"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def run_block_size(self) -> int:
        return max(1, self.block_size // self.scale)

    def engine_config(
        self, num_kv_blocks: int, max_model_len: int, max_num_seqs: int, caching: bool
    ) -> EngineConfig:
        # No watermark: both engines of a comparison hold exactly the blocks they need.
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            attention_backend=self.attention_backend,
            block_size=self.run_block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(1, self.max_num_batched_tokens // self.scale),
            enable_prefix_caching=caching,
            watermark=0.0,
        )


def _positive_ints(name: str, values: tuple[int, ...]) -> None:
    if not values or any(not isinstance(v, int) or v <= 0 for v in values):
        raise ValueError(f"{name} must be a non-empty list of positive integers, got {values!r}")


@dataclass(frozen=True)
class PrefixConfig:
    """Shared system prompt: for each prefix length ``S`` and request count ``N``, ``N`` requests
    of ``S`` common + ``user_len`` unique prompt tokens, ``output_len`` greedy tokens each.
    Lengths are divided by the engine options' ``scale``."""

    prefix_lens: tuple[int, ...] = (256, 1024)
    num_requests: tuple[int, ...] = (1, 4, 16, 64)
    user_len: int = 32
    output_len: int = 16
    warm: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_ints("prefix_lens", self.prefix_lens)
        _positive_ints("num_requests", self.num_requests)
        for name in ("user_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def lengths(self, prefix_len: int, scale: int) -> tuple[int, int, int]:
        """(prefix, user part, output) lengths of a run at ``scale``."""
        if prefix_len % scale:
            raise ValueError(f"scale {scale} must divide every prefix length, got {prefix_len}")
        return prefix_len // scale, max(1, self.user_len // scale), max(1, self.output_len // scale)

    def prompts(self, prefix_len: int, user_len: int, count: int, vocab_size: int) -> list[list[int]]:
        """``count`` prompts: one common prefix, then unique user parts (seeded per prefix length)."""
        rng = np.random.default_rng([self.seed, prefix_len])
        prefix = rng.integers(FIRST_TOKEN_ID, vocab_size, prefix_len).tolist()
        users = rng.integers(FIRST_TOKEN_ID, vocab_size, (count, user_len)).tolist()
        return [prefix + user for user in users]


@dataclass(frozen=True)
class ForkConfig:
    """Parallel sampling and beam search: ``num_prompts`` prompts from the ``mix``, each decoded
    with every width in ``widths`` as ``n`` samples and as that many beams."""

    mix: str = "alpaca"
    num_prompts: int = 16
    widths: tuple[int, ...] = (2, 4, 6)
    max_model_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mix not in MIXES:
            raise ValueError(f"mix must be one of {MIXES}, got {self.mix!r}")
        _positive_ints("widths", self.widths)
        if not isinstance(self.num_prompts, int) or self.num_prompts <= 0:
            raise ValueError(f"num_prompts must be a positive integer, got {self.num_prompts!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 4:
            raise ValueError(f"max_model_len must be an integer >= 4, got {self.max_model_len!r}")

    def lengths(self, scale: int = 1) -> list[tuple[int, int]]:
        """(prompt, output) length per prompt, divided by ``scale``.

        ``alpaca``: log-normal prompts and outputs with the paper's Alpaca means (19.3 and 58.5
        tokens); ``sharegpt``: the simulator's ShareGPT mix (means ~160 and ~340).
        """
        rng = np.random.default_rng([self.seed, 7])
        if self.mix == "alpaca":
            prompt = _lognormal(rng, ALPACA_PROMPT_MEAN, ALPACA_SIGMA, self.num_prompts)
            output = _lognormal(rng, ALPACA_OUTPUT_MEAN, ALPACA_SIGMA, self.num_prompts)
            pairs = list(zip(np.rint(prompt).astype(int), np.rint(output).astype(int), strict=True))
        else:
            sampled = Workload("sharegpt", self.max_model_len).sample(rng, self.num_prompts)
            pairs = [(r.prompt_len, r.output_len) for r in sampled]
        limit = self.max_model_len // scale
        lengths = []
        for p, o in pairs:
            p = min(max(1, int(p) // scale), limit - 1)
            lengths.append((p, min(max(1, int(o) // scale), limit - p)))
        return lengths

    def requests(self, vocab_size: int, scale: int = 1) -> list[tuple[list[int], int]]:
        """(prompt token ids, output length) per prompt; token ids seeded apart from lengths."""
        rng = np.random.default_rng([self.seed, 8])
        return [(rng.integers(FIRST_TOKEN_ID, vocab_size, p).tolist(), o) for p, o in self.lengths(scale)]


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """Log-normal samples with the given mean (not median)."""
    return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)


# -- measuring a live engine ---------------------------------------------------------------------
@dataclass(frozen=True)
class KVSample:
    """The KV cache while one forward pass runs."""

    used_blocks: int  # physical blocks held (a shared block counts once)
    table_blocks: int  # sum of the live sequences' block-table lengths: each a private copy
    prefill_tokens: int  # prompt tokens this step computes


class MeasuredEngine:
    """An engine on its own clock that samples its KV cache at every forward pass.

    ``samples`` has one :class:`KVSample` per forward pass; per request id, ``arrival`` and
    ``first_token`` are clock readings, ``outputs`` the finished token ids (one list per sample
    or beam) and ``cached_tokens`` the prompt tokens the prefix cache served.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._prime()
        self.clock = 0.0
        self.samples: list[KVSample] = []
        self.arrival: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.outputs: dict[str, list[list[int]]] = {}
        self.cached_tokens: dict[str, int] = {}

    def _prime(self) -> None:
        """Run one one-token request and forget its cached blocks: the first forward passes of
        an engine pay one-off costs (thread pools, allocator growth) that would otherwise land
        on whichever engine of a comparison steps first."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.engine.add_request("prime", [FIRST_TOKEN_ID], params)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.reset_prefix_cache()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams | BeamSearchParams) -> None:
        if isinstance(params, BeamSearchParams):
            self.engine.add_beam_request(request_id, prompt, params)
        else:
            self.engine.add_request(request_id, prompt, params)
        self.arrival[request_id] = self.clock

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        """One engine step, timed on this engine's clock."""
        outputs = self.engine.step()
        stats = self.engine.last_step
        self.clock += stats.step_time_s
        # KV use while the forward pass ran: the step's blocks all allocated, none yet released.
        self.samples.append(
            KVSample(stats.kv_blocks_at_forward, stats.kv_table_blocks_at_forward, stats.prefill_tokens)
        )
        for out in outputs:  # a request's first output carries its first token
            self.first_token.setdefault(out.request_id, self.clock)
            if out.finished:
                self.outputs[out.request_id] = [c.token_ids for c in out.outputs]
                self.cached_tokens[out.request_id] = out.num_cached_tokens

    def drain(self) -> None:
        while not self.done:
            self.step()

    def ttft(self, request_ids: list[str]) -> list[float]:
        return [self.first_token[r] - self.arrival[r] for r in request_ids]


def mean(values: list[float] | list[int]) -> float:
    return float(np.mean(values)) if values else math.nan


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
    driver: MeasuredEngine, ids: list[str], prompt_tokens: int, first_sample: int, hits_before: int
) -> PrefixRun:
    engine = driver.engine
    stats = engine.stats()
    return PrefixRun(
        caching=engine.config.enable_prefix_caching,
        samples=driver.samples[first_sample:],
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
        MeasuredEngine(options.engine_config(num_kv_blocks, s + user + out, num_requests + warm, caching))
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
        marks.append((len(driver.samples), driver.engine.stats().prefix_cache_hits))
    ids = [f"req-{i}" for i in range(num_requests)]
    for driver in drivers:
        for request_id, prompt in zip(ids, prompts[:num_requests], strict=True):
            driver.submit(request_id, prompt, params)
    while not all(d.done for d in drivers):
        for driver in drivers:
            if not driver.done:
                driver.step()
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
    driver = MeasuredEngine(options.engine_config(num_kv_blocks, max_len, width * len(lengths), False))
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
    return ForkRun(kind, width, driver.samples, stats.preemptions, stats.kv.used_blocks)


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
    prefix_config: PrefixConfig | None = PrefixConfig(),
    fork_config: ForkConfig | None = ForkConfig(),
    progress: bool = False,
) -> SharingResult:
    """Run the experiments that are given (None skips one)."""
    start = time.perf_counter()
    result = SharingResult(options, prefix_config, fork_config)
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


# -- report --------------------------------------------------------------------------------------
