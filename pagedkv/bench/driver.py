"""What the live-engine benchmarks share: their engine options and an engine on its own clock.

A benchmark compares engines (policies, caching on and off) in one process on a machine where
other work comes and goes. So each engine keeps its own clock -- the sum of its own step times,
from the engine's statistics records -- and the engines of a comparison are stepped in turn:
a burst of background load then hits all of them alike. Everything measured comes from the
records the engine publishes (:mod:`pagedkv.engine.stats`), never from its internals.

Nothing here imports torch at module level: the command line imports this module to build its
parser.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.cli_args import config_from_args, positive_int
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_policy import PAGED, KVPolicy

if TYPE_CHECKING:
    from pagedkv.engine import BeamSearchParams, LLMEngine, RequestOutput, SamplingParams
    from pagedkv.engine.stats import StepStats

#: First token id drawn for prompts: ids below it are the built-in tokenizer's special tokens.
FIRST_TOKEN_ID = 4


def mean(values: list[float] | list[int]) -> float:
    """The mean, or NaN for no values (a figure that does not exist, shown as "-")."""
    return float(np.mean(values)) if values else math.nan


@dataclass(frozen=True)
class EngineOptions:
    """The engine settings a benchmark lets users change; defaults are EngineConfig's.

    ``scale`` divides the block size and the per-step token budget (each benchmark divides its
    lengths by it too), so a scaled run keeps the shape of the full one with fewer tokens.
    ``threads`` sets torch's CPU threads for the run (None: torch's choice).
    """

    model: str | None = None
    dtype: str = EngineConfig.dtype
    attention_backend: str | None = None
    block_size: int = EngineConfig.block_size
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    kv_cache_dtype: str = EngineConfig.kv_cache_dtype
    decode_headroom: float = EngineConfig.decode_headroom
    scale: int = 1
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "scale"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise ValueError(f"threads must be a positive integer or None, got {self.threads!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options of a command built with ``add_engine_options`` and :func:`add_run_options`
        (an engine option the command does not offer keeps its default)."""
        return config_from_args(cls, args)

    @property
    def run_block_size(self) -> int:
        return max(1, self.block_size // self.scale)

    def engine_config(
        self,
        num_kv_blocks: int,
        max_model_len: int,
        max_num_seqs: int | None = None,
        enable_prefix_caching: bool | None = None,
        kv_policy: KVPolicy = PAGED,
    ) -> EngineConfig:
        """The engine of one run: exactly ``num_kv_blocks`` blocks (no watermark, so every engine
        of a comparison holds the same budget)."""
        caching = self.enable_prefix_caching if enable_prefix_caching is None else enable_prefix_caching
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            attention_backend=self.attention_backend,
            block_size=self.run_block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs if max_num_seqs is None else max_num_seqs,
            max_num_batched_tokens=max(1, self.max_num_batched_tokens // self.scale),
            enable_prefix_caching=caching,
            kv_cache_dtype=self.kv_cache_dtype,
            watermark=0.0,
            decode_headroom=self.decode_headroom,
            kv_policy=kv_policy,
        )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--scale`` and ``--threads``: the options every live-engine benchmark adds to the engine's."""
    run = parser.add_argument_group("run")
    run.add_argument(
        "--scale",
        type=int,
        default=1,
        help="divide every length, the budget and the block size by this, for a quick run (default: 1)",
    )
    run.add_argument(
        "--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)"
    )


@contextlib.contextmanager
def run_settings(threads: int | None) -> Iterator[None]:
    """Silence the scheduler's warning at every preemption (the benchmarks count them instead)
    and use ``threads`` torch threads; both restored afterwards."""
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


@dataclass
class MeasuredEngine:
    """An engine on its own clock, with every step's statistics record.

    ``steps`` holds one :class:`~pagedkv.engine.stats.StepStats` per step and ``clock`` the
    engine's time after each (``clocks``); per request id, ``arrival`` and ``first_token`` are
    clock readings, ``outputs`` the finished token ids (one list per sample or beam) and
    ``cached_tokens`` the prompt tokens the prefix cache served.
    """

    engine: LLMEngine
    clock: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    clocks: list[float] = field(default_factory=list)
    arrival: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    #: Per request id, the index in ``steps`` of the step that produced its first token.
    first_token_step: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, config: EngineConfig, prime: bool = True) -> MeasuredEngine:
        from pagedkv.engine import LLMEngine

        measured = cls(LLMEngine(config))
        if prime:
            measured.prime()
        return measured

    def prime(self) -> None:
        """Run one one-token request and forget its cached blocks: the first forward passes of
        an engine pay one-off costs (thread pools, allocator growth) that would otherwise land
        on whichever engine of a comparison steps first."""
        from pagedkv.engine import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.engine.add_request("prime", [FIRST_TOKEN_ID], params)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.reset_prefix_cache()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams | BeamSearchParams) -> None:
        from pagedkv.engine import BeamSearchParams

        if isinstance(params, BeamSearchParams):
            self.engine.add_beam_request(request_id, prompt, params)
        else:
            self.engine.add_request(request_id, prompt, params)
        self.arrival[request_id] = self.clock

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step, timed on this engine's clock (by the engine's own record of it)."""
        outputs = self.engine.step()
        stats = self.engine.last_step
        if stats is None or (self.steps and stats.step == self.steps[-1].step):
            return outputs  # nothing was scheduled: no step happened
        self.clock += stats.step_time_s
        self.steps.append(stats)
        self.clocks.append(self.clock)
        for out in outputs:  # a request's first output carries its first token
            self.first_token.setdefault(out.request_id, self.clock)
            self.first_token_step.setdefault(out.request_id, len(self.steps) - 1)
            if out.finished:
                self.outputs[out.request_id] = [c.token_ids for c in out.outputs]
                self.cached_tokens[out.request_id] = out.num_cached_tokens
        return outputs

    def drain(self) -> None:
        while not self.done:
            self.step()

    def ttft(self, request_ids: list[str]) -> list[float]:
        return [self.first_token[r] - self.arrival[r] for r in request_ids]


def step_in_turn(engines: list[MeasuredEngine]) -> Iterator[list[RequestOutput]]:
    """Step every unfinished engine once per round until all are done; yield each step's outputs."""
    active = [e for e in engines if not e.done]
    while active:
        for measured in active:
            yield measured.step()
        active = [e for e in active if not e.done]
