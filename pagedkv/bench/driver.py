"""The one driver of ``pagedkv bench``: a bench's command, its engines on their own clocks, its run.

A bench is a configuration -- a frozen dataclass whose fields are declared with
:func:`~pagedkv.bench.options.option`, each a checked value and a command-line flag -- a ``run``
that turns it into a result, and a ``report`` that prints the result's tables. :func:`add_bench` makes that a
subcommand; :func:`measure` runs it with the machine's load measured around it, and
:func:`finish` writes the plots and ``<out>/<bench>.json`` and prints the tables or the JSON.

A comparison runs its engines in one process and steps them in turn (:func:`step_in_turn`),
each on its own clock -- the sum of its own step times, from the statistics records the engine
publishes (:mod:`pagedkv.engine.stats`) -- so a burst of background load on a shared machine hits
all of them alike.

Nothing here imports torch at module level: the command line builds its parser from this module.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.table import Table

from pagedkv.bench.host import LoadMeter, print_host
from pagedkv.bench.options import add_options, check_options, option, require_positive
from pagedkv.cli_args import add_engine_options, engine_config
from pagedkv.cli_parsing import add_command, config_from_args
from pagedkv.cli_report import ReportOptions, add_report_options
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.core.kv_policy import PAGED, KVPolicy

if TYPE_CHECKING:
    from pagedkv.engine import BeamSearchParams, LLMEngine, RequestOutput, SamplingParams
    from pagedkv.engine.stats import StepStats

#: First token id drawn for prompts: ids below it are the built-in tokenizer's special tokens.
FIRST_TOKEN_ID = 4


def progress(message: str) -> None:
    """A progress line on stderr (stdout holds the report or the JSON document)."""
    print(message, file=sys.stderr, flush=True)


def mean(values: list[float] | list[int]) -> float:
    """The mean, or NaN for no values (a figure that does not exist, shown as "-")."""
    return float(np.mean(values)) if values else math.nan


def config_from(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """``cls`` from the parsed flags named like its fields (lists as tuples; a choice list without
    duplicates), its ``engine`` from the engine options; a bad value is a usage error."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if isinstance(value, list):
            choices = f.metadata.get("option", {}).get("choices")
            values[f.name] = tuple(dict.fromkeys(value) if choices else value)
        elif f.name == "engine":
            values[f.name] = (
                engine_config(args) if f.type == "EngineConfig" else EngineOptions.from_args(args)
            )
    return config_from_args(cls, args, **(values | overrides))


# -- engines ---------------------------------------------------------------------------------------
#: The options of a run that are not the engine's own: ``--scale`` and ``--threads``.
RUN_FIELDS = {"scale", "threads"}


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
    quantized_activations: str = EngineConfig.quantized_activations
    scale: int = option(
        1, "divide every length, the budget and the block size by this, for a quick run", group="run"
    )
    threads: int | None = option(
        None, "torch CPU threads (default: torch's choice)", positive=True, group="run"
    )

    def __post_init__(self) -> None:
        require_positive(self, "block_size", "max_num_seqs", "max_num_batched_tokens", "scale")
        check_options(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options a command offers (an engine option it does not offer keeps its default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in vars(args).items() if name in names})

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
            quantized_activations=self.quantized_activations,
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

    ``steps`` holds one :class:`~pagedkv.engine.stats.StepStats` per step; per request id,
    ``arrival`` and ``first_token`` are clock readings, ``first_token_step`` the index in
    ``steps`` of the step that produced the first token, ``outputs`` the finished token ids (one
    list per sample or beam) and ``cached_tokens`` the prompt tokens the prefix cache served.
    """

    engine: LLMEngine
    clock: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    arrival: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    first_token_step: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, config: EngineConfig, prime: bool = True) -> MeasuredEngine:
        from pagedkv.engine import LLMEngine

        measured = cls(LLMEngine(config))
        if prime:
            measured.prime()
        return measured

    def prime(self, keep_cache: bool = False) -> None:
        """Run one one-token request and forget its cached blocks: the first forward passes of
        an engine pay one-off costs (thread pools, allocator growth) that would otherwise land
        on whichever engine of a comparison steps first. ``keep_cache``: leave the prefix cache
        alone (a one-token prompt fills no block; a reset would also clear a second KV tier a
        restarted engine found)."""
        from pagedkv.engine import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.engine.add_request("prime", [FIRST_TOKEN_ID], params)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        if not keep_cache:
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


def step_in_turn(engines: list[MeasuredEngine]) -> None:
    """Step every unfinished engine once per round until all are done."""
    active = [e for e in engines if not e.done]
    while active:
        for measured in active:
            measured.step()
        active = [e for e in active if not e.done]


# -- the command ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bench:
    """One ``pagedkv bench`` command. ``doc``: its help (first paragraph) and description;
    ``run(config)`` returns a result with ``to_json()`` and ``ok`` (the exit status);
    ``report(result, console)`` prints its tables and ``plots(result, folder)`` writes its figures
    (each imports torch or matplotlib only when called: the parser is built without them);
    ``engine_fields``: the engine options a bench with an ``engine`` field offers (None: all),
    with defaults of its own in ``engine_defaults``."""

    name: str
    doc: str
    config: type
    run: Callable[[Any], Any]
    report: Callable[[Any, Console], None]
    plots: Callable[[Any, Path], list[Path]] | None = None
    engine_fields: tuple[str, ...] | None = ()
    engine_defaults: dict[str, Any] = field(default_factory=dict)


def add_bench(subparsers: argparse._SubParsersAction, bench: Bench) -> argparse.ArgumentParser:
    """``pagedkv bench <name>``: the config's options, the engine's, ``--out``/``--json``/``--no-plots``."""
    parser = add_command(subparsers, bench.name, lambda args: run_command(bench, args), bench.doc)
    add_options(parser, bench.config)
    if any(f.name == "engine" for f in dataclasses.fields(bench.config)):
        offered = None if bench.engine_fields is None else set(bench.engine_fields) - RUN_FIELDS
        add_engine_options(parser, offered, **bench.engine_defaults)
        add_options(parser, EngineOptions, only=set(bench.engine_fields or ()) & RUN_FIELDS)
    written = f"{bench.name}.json" + (" and the plots" if bench.plots else "")
    add_report_options(parser, plots=bench.plots is not None, out_help=f"folder for {written}")
    return parser


def run_command(bench: Bench, args: argparse.Namespace) -> int:
    result, machine = measure(bench, config_from(bench.config, args))
    finish(args, bench, result, machine)
    return 0 if result.ok else 1


def run_section(bench: Bench, config: Any, console: Console, out: Path) -> tuple[Any, list[Path]]:
    """Run ``bench`` on ``config`` and show it as a section of a longer report (``pagedkv demo``):
    its tables on ``console``, its plots and JSON under ``out``; the result and the plots."""
    result, machine = measure(bench, config)
    return result, finish(ReportOptions(Path(out)), bench, result, machine, console)


def measure(bench: Bench, config: Any) -> tuple[Any, dict]:
    """Run the bench; the result, and what the machine did meanwhile (with the host probes a
    result may carry in ``host``)."""
    meter = LoadMeter()
    result = bench.run(config)
    return result, meter.stop() | getattr(result, "host", {})


def finish(
    options: argparse.Namespace | ReportOptions,
    bench: Bench,
    result: Any,
    machine: dict,
    console: Console | None = None,
) -> list[Path]:
    """Write the plots (unless ``--no-plots``) and ``<out>/<bench>.json``, then print that
    document (``--json``) or the report, the host's lines and the plots' paths; the plots."""
    out = Path(options.out)
    plots = bench.plots
    written = [] if plots is None or options.no_plots else plots(result, out)
    document = result.to_json() | {"machine": machine} | ({"plots": list(map(str, written))} if plots else {})
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, indent=2, default=str)
    (out / f"{bench.name}.json").write_text(text + "\n", encoding="utf-8")
    progress(f"figures saved to {out / f'{bench.name}.json'}")
    if options.json:
        print(text)
        return written
    console = console or Console()
    bench.report(result, console)
    print_host(machine, console)
    if written:  # soft_wrap: a path longer than the terminal stays one string the user can copy
        console.print(f"\nPlots written to [bold]{written[0].parent}/[/]:", soft_wrap=True)
        for path in written:
            console.print(f"  {path}", soft_wrap=True)
    return written


# -- tables --------------------------------------------------------------------------------------
def table(
    title: str | None, columns: tuple[str, ...], left: int = 1, no_wrap: bool = False, **options: Any
) -> Table:
    """A table whose first ``left`` columns are text (left-aligned) and the rest figures."""
    made = Table(title=title, **options)
    for i, column in enumerate(columns):
        made.add_column(column, justify="left" if i < left else "right", no_wrap=no_wrap)
    return made


def cell(value: float | None, spec: str = ",.0f", suffix: str = "") -> str:
    """A figure, or "-" where it does not exist (None or NaN)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec) + suffix


def print_checks(console: Console, checks: list[tuple[str, bool]]) -> None:
    """One line per goal: met or not."""
    for label, ok in checks:
        console.print(f"  {'[green]met[/]' if ok else '[red]NOT met[/]'}  {label}")
