"""``pagedkv bench sharing``: the KV memory that block sharing saves, measured in the live engine.

Two experiments on the same model and kernels:

* **Shared system prompt.** ``N`` requests = one common ``S``-token prefix + a unique user part,
  all submitted at once, through two engines that differ only in prefix caching, stepped in turn
  on their own clocks; greedy outputs must be identical. The requests of the first step all
  compute the prefix: a block is offered to other requests once a step has computed it (vLLM v1
  offers it when scheduled). ``warm`` first sends one request with the same system prompt: the
  steady state of a server that has seen the prompt.
* **Parallel sampling and beam search.** A batch of prompts with an Alpaca-like (or
  ShareGPT-like) length mix, each decoded as ``n`` samples or ``beam_width`` beams, which fork one
  block table (copy-on-write); "without sharing" is what the same sequences would hold if each
  had a private copy of every block in its table.

KV use is what each step's statistics record says the forward pass held -- after the scheduler
allocated the step's slots and copy-on-write blocks, before anything was freed: the memory the
step really needs. Averages over time are per engine step, so they are reproducible. Tables and
plots: :mod:`pagedkv.bench.sharing_report`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedkv.bench.driver import (
    FIRST_TOKEN_ID,
    EngineOptions,
    MeasuredEngine,
    mean,
    progress,
    run_settings,
    step_in_turn,
)
from pagedkv.bench.options import check_options, option
from pagedkv.engine import BeamSearchParams, SamplingParams
from pagedkv.memory import blocks_for
from pagedkv.sim.workloads import Workload

PARTS = ("all", "prefix", "fork")
MIXES = ("alpaca", "sharegpt")
FORK_KINDS = ("parallel", "beam")
PREFIX, FORK = "shared system prompt", "parallel sampling and beam search"
#: Means of the PagedAttention paper's Alpaca trace (its Fig. 11). Log-normal spreads are our choice.
ALPACA_PROMPT_MEAN, ALPACA_OUTPUT_MEAN, ALPACA_SIGMA = 19.3, 58.5, 0.5
#: Memory saved by sharing in the paper (Fig. 15 and Sec. 6.3), OPT-13B, widths 2, 4 and 6.
PAPER_SAVING = {
    "alpaca": {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)},
    "sharegpt": {"parallel": (0.162, 0.305), "beam": (0.443, 0.663)},
}


@dataclass(frozen=True)
class SharingConfig:
    """The experiments of ``part``. Shared prompt: for each prefix length ``S`` and request count
    ``N``, ``N`` requests of ``S`` common + ``user_len`` unique prompt tokens, ``output_len``
    greedy tokens each. Forks: ``num_prompts`` prompts of the ``mix``, each decoded with every
    width as ``n`` samples and as that many beams. Lengths are divided by the engine's ``scale``."""

    part: str = option("all", "experiments to run", choices=PARTS)
    prefix_lens: tuple[int, ...] = option((256, 1024), "common prefix lengths S", positive=True, group=PREFIX)
    num_requests: tuple[int, ...] = option((1, 4, 16, 64), "request counts N", positive=True, group=PREFIX)
    user_len: int = option(32, "unique prompt tokens per request", positive=True, group=PREFIX)
    output_len: int = option(16, "greedy output tokens", positive=True, group=PREFIX)
    warm: bool = option(False, "send one request with the system prompt first (steady state)", group=PREFIX)
    mix: str = option("alpaca", "prompt/output length mix", choices=MIXES, group=FORK)
    num_prompts: int = option(16, "prompts in the batch", positive=True, group=FORK)
    widths: tuple[int, ...] = option((2, 4, 6), "samples n and beam widths", positive=True, group=FORK)
    seed: int = option(0, "random seed")
    max_model_len: int = 2048
    engine: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        check_options(self)
        scale = self.engine.scale
        if self.part != "fork" and any(s % scale for s in self.prefix_lens):
            raise ValueError(f"scale {scale} must divide every prefix length, got {self.prefix_lens}")

    def prefix_lengths(self, prefix_len: int) -> tuple[int, int, int]:
        """(prefix, user part, output) lengths of a run at the engine's scale."""
        scale = self.engine.scale
        return prefix_len // scale, max(1, self.user_len // scale), max(1, self.output_len // scale)

    def prefix_prompts(self, prefix_len: int, user_len: int, count: int, vocab_size: int) -> list[list[int]]:
        """``count`` prompts: one common prefix, then unique user parts (seeded per prefix length)."""
        rng = np.random.default_rng([self.seed, prefix_len])
        prefix = rng.integers(FIRST_TOKEN_ID, vocab_size, prefix_len).tolist()
        return [
            prefix + user for user in rng.integers(FIRST_TOKEN_ID, vocab_size, (count, user_len)).tolist()
        ]

    def fork_lengths(self) -> list[tuple[int, int]]:
        """(prompt, output) length per prompt at the engine's scale: ``alpaca`` log-normal with the
        paper's means, ``sharegpt`` the simulator's ShareGPT mix."""
        rng = np.random.default_rng([self.seed, 7])
        if self.mix == "alpaca":
            pairs = [
                np.rint(
                    rng.lognormal(np.log(m) - ALPACA_SIGMA**2 / 2, ALPACA_SIGMA, self.num_prompts)
                ).astype(int)
                for m in (ALPACA_PROMPT_MEAN, ALPACA_OUTPUT_MEAN)
            ]
            pairs = list(zip(*pairs, strict=True))
        else:
            pairs = [
                (r.prompt_len, r.output_len)
                for r in Workload("sharegpt", self.max_model_len).sample(rng, self.num_prompts)
            ]
        scale, limit = self.engine.scale, self.max_model_len // self.engine.scale
        lengths = []
        for p, o in pairs:
            p = min(max(1, int(p) // scale), limit - 1)
            lengths.append((p, min(max(1, int(o) // scale), limit - p)))
        return lengths

    def fork_requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """(prompt token ids, output length) per prompt; token ids seeded apart from lengths."""
        rng = np.random.default_rng([self.seed, 8])
        return [(rng.integers(FIRST_TOKEN_ID, vocab_size, p).tolist(), o) for p, o in self.fork_lengths()]


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

    def to_json(self) -> dict:
        figures = ("peak_blocks", "mean_blocks", "prompt_tokens", "prefill_computed", "prefill_skipped")
        return {name: getattr(self, name) for name in figures} | {
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
        sizes = {
            name: getattr(self, name) for name in ("prefix_len", "num_requests", "user_len", "output_len")
        }
        return sizes | {
            "outputs_identical": self.outputs_identical,
            "cold_requests": self.cold_requests,
            "peak_blocks_saved": self.blocks_saved,
            "caching_on": self.on.to_json(),
            "caching_off": self.off.to_json(),
        }


def _prefix_run(
    measured: MeasuredEngine, ids: list[str], prompt_tokens: int, first_step: int, hits: int
) -> PrefixRun:
    stats = measured.engine.stats()
    return PrefixRun(
        samples=kv_samples(measured, first_step),
        prompt_tokens=prompt_tokens,
        prefix_hit_tokens=stats.prefix_cache_hits - hits,
        ttft=measured.ttft(ids),
        outputs={r: measured.outputs[r] for r in ids},
        cached_tokens=[measured.cached_tokens[r] for r in ids],
        preemptions=stats.preemptions,
        blocks_used_after=stats.kv.used_blocks,
    )


def run_prefix_point(config: SharingConfig, prefix_len: int, num_requests: int) -> PrefixPoint:
    """``num_requests`` requests sharing a ``prefix_len``-token prefix, caching on vs off."""
    s, user, out = config.prefix_lengths(prefix_len)
    warm = int(config.warm)
    # Room for every request (and the warm-up) with nothing shared: no preemption either way.
    bs = config.engine.run_block_size
    num_kv_blocks = (num_requests + warm) * blocks_for(s + user + out, bs)
    engines = [
        MeasuredEngine.start(
            config.engine.engine_config(num_kv_blocks, s + user + out, num_requests + warm, caching)
        )
        for caching in (True, False)
    ]
    prompts = config.prefix_prompts(s, user, num_requests + warm, engines[0].engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    marks = []
    for measured in engines:
        if warm:
            measured.submit("warm-up", prompts[-1], params)
            measured.drain()
        marks.append((len(measured.steps), measured.engine.stats().prefix_cache_hits))
    ids = [f"req-{i}" for i in range(num_requests)]
    for measured in engines:
        for request_id, prompt in zip(ids, prompts, strict=False):
            measured.submit(request_id, prompt, params)
    step_in_turn(engines)
    on, off = (
        _prefix_run(m, ids, num_requests * (s + user), *mark) for m, mark in zip(engines, marks, strict=True)
    )
    return PrefixPoint(s, num_requests, user, out, bs, on=on, off=off)


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
        unshared = sum(s.table_blocks for s in self.samples)
        return 1 - sum(s.used_blocks for s in self.samples) / unshared if unshared else math.nan

    @property
    def peak_blocks(self) -> int:
        return max((s.used_blocks for s in self.samples), default=0)

    @property
    def peak_blocks_without_sharing(self) -> int:
        return max((s.table_blocks for s in self.samples), default=0)

    @property
    def peak_saving(self) -> float:
        """1 - peak blocks held / peak blocks without sharing."""
        private = self.peak_blocks_without_sharing
        return 1 - self.peak_blocks / private if private else math.nan

    def to_json(self) -> dict:
        names = ("kind", "width", "saving", "peak_saving", "peak_blocks", "peak_blocks_without_sharing")
        figures = {name: getattr(self, name) for name in names}
        return figures | {
            "steps": len(self.samples),
            "preemptions": self.preemptions,
            "blocks_used_after": self.blocks_used_after,
        }


def run_fork(config: SharingConfig, kind: str, width: int) -> ForkRun:
    """Every prompt of the mix decoded as ``width`` samples or beams, all submitted at once."""
    lengths = config.fork_lengths()
    # Every sequence with a private copy of its whole table fits: no preemption.
    num_kv_blocks = sum(width * blocks_for(p + o, config.engine.run_block_size) for p, o in lengths) + width
    max_len = max(p + o for p, o in lengths)
    measured = MeasuredEngine.start(
        config.engine.engine_config(num_kv_blocks, max_len, width * len(lengths), False)
    )
    for i, (prompt, output_len) in enumerate(config.fork_requests(measured.engine.model_config.vocab_size)):
        if kind == "parallel":
            params = SamplingParams(
                n=width, max_tokens=output_len, temperature=1.0, seed=config.seed + i, ignore_eos=True
            )
        else:
            params = BeamSearchParams(beam_width=width, max_tokens=output_len, ignore_eos=True)
        measured.submit(f"{kind}-{i}", prompt, params)
    measured.drain()
    stats = measured.engine.stats()
    return ForkRun(kind, width, kv_samples(measured), stats.preemptions, stats.kv.used_blocks)


# -- the whole benchmark -------------------------------------------------------------------------
@dataclass
class SharingResult:
    config: SharingConfig
    prefix: list[PrefixPoint] = field(default_factory=list)
    forks: list[ForkRun] = field(default_factory=list)

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
            "config": asdict(self.config),
            "shared_prefix": [p.to_json() for p in self.prefix],
            "forks": [r.to_json() for r in self.forks],
            "paper_saving": PAPER_SAVING,
            "outputs_identical": self.outputs_identical,
            "blocks_returned": self.blocks_returned,
        }


def run_sharing(config: SharingConfig) -> SharingResult:
    """Run the experiments of ``config.part``."""
    result = SharingResult(config)
    points = itertools.product(config.prefix_lens, config.num_requests)
    forks = itertools.product(FORK_KINDS, config.widths)
    with run_settings(config.engine.threads):
        for s, n in points if config.part in ("all", "prefix") else ():
            progress(f"sharing: {n} requests sharing a {s}-token prefix, caching on and off")
            result.prefix.append(run_prefix_point(config, s, n))
        for kind, width in forks if config.part in ("all", "fork") else ():
            progress(f"sharing: {config.num_prompts} prompts as {width} {kind} sequences each")
            result.forks.append(run_fork(config, kind, width))
    return result


def demo_config(seed: int = 0) -> SharingConfig:
    """The ``pagedkv demo`` section: 4 and 16 requests sharing a 256-token system prompt after a
    warm-up request, and eight Alpaca-like prompts as four samples and four beams."""
    return SharingConfig(
        prefix_lens=(256,),
        num_requests=(4, 16),
        output_len=8,
        warm=True,
        num_prompts=8,
        widths=(4,),
        seed=seed,
    )
