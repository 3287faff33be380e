"""``pagedkv bench structured``: what constraining the output to a JSON schema costs.

For each share of constrained rows (0 %, 50 %, 100 % by default), a batch of ``batch_size``
chat requests runs twice in a round, on one engine:

1. **constrained**: that share of the rows carries the schema (seeded sampling, each row ends
   when its JSON is complete), the others are unconstrained;
2. **unconstrained**: the same prompts, every row unconstrained, each generating exactly as many
   tokens as its row did in (1) (EOS ignored) -- so both runs step the same batch shapes and only
   the grammar's work (the mask of each constrained row every step, its matcher advanced by
   every token) differs.

Rounds interleave the shares and the two runs, so a machine that slows down slows every
column alike; the figure is the median over rounds of generated tokens/s, constrained over
unconstrained. The grammars are compiled before any timed run (a request's compile happens
once, before it is queued); their compile time is measured apart: the backend's first build
(reading the vocabulary), a cold compile of a new schema, and a cached one.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console

from pagedkv.bench.driver import EngineOptions, cell, print_checks, progress, run_settings, table
from pagedkv.bench.options import check_options, option

if TYPE_CHECKING:
    from pagedkv.engine import LLMEngine, SamplingParams

#: A small record, every field bounded so each constrained row ends well within max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "active", "tags"],
    "additionalProperties": False,
}
PROMPT = (
    "<|im_start|>user\nReturn a JSON object with name, age, city, active, tags.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@dataclass(frozen=True)
class StructuredConfig:
    """``rounds`` rounds of every share in ``constrained_pct``, on batches of ``batch_size`` rows
    of at most ``max_tokens`` tokens; ``compiles`` cold compiles of distinct schemas."""

    constrained_pct: tuple[int, ...] = option((0, 50, 100), "shares of the batch's rows constrained, in %%")
    batch_size: int = option(32, "rows of a batch", positive=True)
    max_tokens: int = option(128, "most tokens a row generates", positive=True)
    rounds: int = option(5, "interleaved rounds (the figures are their medians)", positive=True)
    compiles: int = option(5, "distinct schemas compiled cold", positive=True)
    goal_pct: float = option(85.0, "tokens/s a fully constrained batch keeps, in %% of unconstrained")
    disable_any_whitespace: bool = option(False, "JSON without whitespace between its tokens")
    seed: int = option(0, "seed of the rows' sampling")
    num_kv_blocks: int = 2048
    engine: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        check_options(self)
        if not all(0 <= pct <= 100 for pct in self.constrained_pct):
            raise ValueError(f"constrained_pct must be percentages in [0, 100], got {self.constrained_pct}")


@dataclass
class ShareRow:
    """One share of constrained rows: tokens/s of each run per round, and their ratio."""

    constrained_pct: int
    constrained_rows: int
    tokens: list[int] = field(default_factory=list)
    constrained_tps: list[float] = field(default_factory=list)
    unconstrained_tps: list[float] = field(default_factory=list)
    #: Constrained outputs that parse as JSON and fit the schema, of those constrained.
    valid: int = 0
    checked: int = 0

    @property
    def ratio(self) -> float:
        """Median over rounds of constrained / unconstrained tokens/s."""
        return statistics.median(
            c / u for c, u in zip(self.constrained_tps, self.unconstrained_tps, strict=True)
        )


@dataclass
class StructuredResult:
    config: StructuredConfig
    rows: list[ShareRow]
    #: Seconds: the backend's first build, cold compiles (median), a cached compile (median).
    backend_build_s: float
    cold_compile_s: float
    cached_compile_s: float

    @property
    def full(self) -> ShareRow | None:
        return next((r for r in self.rows if r.constrained_pct == 100), None)

    @property
    def ok(self) -> bool:
        """A fully constrained batch keeps the goal's share of the unconstrained tokens/s."""
        full = self.full
        return full is None or 100 * full.ratio >= self.config.goal_pct

    def to_json(self) -> dict:
        rows = [asdict(row) | {"ratio": row.ratio} for row in self.rows]
        compile_s = {
            "backend_build": self.backend_build_s,
            "cold": self.cold_compile_s,
            "cached": self.cached_compile_s,
        }
        return {"config": asdict(self.config), "rows": rows, "compile_seconds": compile_s, "ok": self.ok}


def _schema_variant(index: int) -> dict[str, Any]:
    """A schema like :data:`SCHEMA` that compiles anew (its ``name`` bound differs)."""
    variant = json.loads(json.dumps(SCHEMA))
    variant["properties"]["name"]["maxLength"] = 25 + index
    return variant


def measure_compiles(engine: LLMEngine, config: StructuredConfig) -> tuple[float, float, float]:
    """(first build, cold compile median, cached compile median), in seconds."""
    from pagedkv.engine import StructuredOutputsParams

    manager = engine.structured_outputs
    started = time.perf_counter()
    first = manager.compile_async(StructuredOutputsParams(json=_schema_variant(-1))).result()
    backend = time.perf_counter() - started - first.compile_seconds
    cold = []
    for index in range(config.compiles):
        cold.append(
            manager.compile_async(StructuredOutputsParams(json=_schema_variant(index)))
            .result()
            .compile_seconds
        )
    cached = []
    for _ in range(20):
        started = time.perf_counter()
        manager.compile_async(StructuredOutputsParams(json=_schema_variant(0))).result()
        cached.append(time.perf_counter() - started)
    return backend, statistics.median(cold), statistics.median(cached)


def _run_batch(
    engine: LLMEngine, params: list[SamplingParams], prompt: list[int]
) -> tuple[list[list[int]], float]:
    """Every row to completion; each row's output tokens and the wall time."""
    started = time.perf_counter()
    for i, row in enumerate(params):
        engine.add_request(f"row-{i}", prompt, row)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    return [finished[f"row-{i}"] for i in range(len(params))], time.perf_counter() - started


def run_share(
    engine: LLMEngine, config: StructuredConfig, row: ShareRow, round_index: int, prompt: list[int]
) -> None:
    """One round of one share: constrained, then the same shapes unconstrained."""
    from pagedkv.engine import SamplingParams, StructuredOutputsParams

    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=config.disable_any_whitespace)
    seed = config.seed + 1000 * round_index
    params = [
        SamplingParams(
            max_tokens=config.max_tokens,
            temperature=1.0,
            seed=seed + i,
            structured_outputs=constraint if i < row.constrained_rows else None,
            ignore_eos=i >= row.constrained_rows,
        )
        for i in range(config.batch_size)
    ]
    outputs, seconds = _run_batch(engine, params, prompt)
    lengths = [len(tokens) for tokens in outputs]
    same_shapes = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=seed + i, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    _, plain_seconds = _run_batch(engine, same_shapes, prompt)
    row.tokens.append(sum(lengths))
    row.constrained_tps.append(sum(lengths) / seconds)
    row.unconstrained_tps.append(sum(lengths) / plain_seconds)
    for tokens in outputs[: row.constrained_rows]:
        row.checked += 1
        row.valid += _fits(engine.tokenizer.decode(tokens))


def _fits(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(SCHEMA["required"])


def run_structured(config: StructuredConfig) -> StructuredResult:
    from pagedkv.engine import LLMEngine, SamplingParams, StructuredOutputsParams

    with run_settings(config.engine.threads):
        engine = LLMEngine(
            config.engine.engine_config(config.num_kv_blocks, 512, max_num_seqs=config.batch_size)
        )
        progress("structured: compiling")
        backend, cold, cached = measure_compiles(engine, config)
        engine.structured_outputs.compile_async(
            StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=config.disable_any_whitespace)
        ).result()
        prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        rows = [ShareRow(pct, round(config.batch_size * pct / 100)) for pct in config.constrained_pct]
        progress("structured: warming up")  # first steps pay one-off costs (thread pools, allocator)
        _run_batch(engine, [SamplingParams(max_tokens=8, ignore_eos=True)] * config.batch_size, prompt)
        for round_index in range(config.rounds):
            for row in rows:
                share = f"{row.constrained_pct} % constrained"
                progress(f"structured: round {round_index + 1}/{config.rounds}, {share}")
                run_share(engine, config, row, round_index, prompt)
        engine.shutdown()
    return StructuredResult(config, rows, backend, cold, cached)


def print_structured(result: StructuredResult, console: Console) -> None:
    config = result.config
    console.print(
        f"[bold]Structured output: the cost of a JSON schema[/] -- {config.batch_size} rows of at most "
        f"{config.max_tokens} tokens, {config.rounds} interleaved rounds; each constrained batch against "
        "the same prompts and row lengths unconstrained."
    )
    rows = table(
        None, ("constrained", "rows", "tokens", "tok/s constrained", "tok/s plain", "kept", "valid JSON")
    )
    for row in result.rows:
        rows.add_row(
            f"{row.constrained_pct} %",
            str(row.constrained_rows),
            cell(statistics.median(row.tokens)),
            cell(statistics.median(row.constrained_tps)),
            cell(statistics.median(row.unconstrained_tps)),
            cell(100 * row.ratio, ".1f", " %"),
            f"{row.valid}/{row.checked}" if row.checked else "-",
        )
    console.print(rows)
    console.print(
        f"Compile: backend build {result.backend_build_s * 1e3:,.0f} ms (once per engine), a new schema "
        f"{result.cold_compile_s * 1e3:,.1f} ms (median of {config.compiles}), cached "
        f"{result.cached_compile_s * 1e6:,.0f} us."
    )
    print_checks(
        console, [(f"a fully constrained batch keeps >= {config.goal_pct:g} % of the tokens/s", result.ok)]
    )
