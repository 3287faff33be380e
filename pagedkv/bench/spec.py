"""``pagedkv bench spec``: speculative decoding against none, and against llama.cpp.

The built-in model (or ``--model``) writes ``--max-tokens`` greedy tokens after the first
``--prompt-len`` tokens of texts it never trained on: held-out Python files of the standard
library (code repeats itself: prompt lookup's case) and the language reference's prose of
``pydoc_data`` (which its training skipped). Each text runs single stream (one request after the
other) and in batches (``--batch-sizes``) through pagedkv without speculation, with n-gram
speculation and with the shipped draft model, and through llama.cpp on the same weights (a GGUF
made from the same folder) with and without its prompt lookup decoding, when ``--llamacpp-python``
is given. Engines take turns workload by workload, round after round, so a burst of other work on
a shared machine lands on all of them; a figure is the generated tokens over the summed wall time
of its engine's runs. Greedy outputs of every pagedkv engine must be identical; llama.cpp's
agreement with them is shown. The tables: :mod:`pagedkv.bench.spec_report`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.bench.driver import progress, run_settings
from pagedkv.bench.host import host_state
from pagedkv.bench.options import check_options, option
from pagedkv.bench.throughput import Workload
from pagedkv.bench.throughput_engines import EngineUnavailable, LoadSpec, RivalEngine
from pagedkv.cli_report import DEFAULT_OUT
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.memory import blocks_for

TEXTS = ("python", "text")
#: Engines in table order, with their titles: pagedkv's three modes, then llama.cpp's two.
ENGINE_TITLES = {
    "off": "pagedkv",
    "ngram": "+ n-gram",
    "draft": "+ draft model",
    "llamacpp": "llama.cpp",
    "llamacpp-lookup": "+ lookup",
}
ENGINES = tuple(ENGINE_TITLES)
SPEC_GROUP = "speculation"


@dataclass(frozen=True)
class SpecConfig:
    """What to run: texts, batch sizes, engines, the speculation settings and the rivals."""

    texts: tuple[str, ...] = option(TEXTS, "", choices=TEXTS, group="what to run")
    batch_sizes: tuple[int, ...] = option((1, 8), "1: single stream", positive=True, group="what to run")
    engines: tuple[str, ...] = option(ENGINES, "", choices=ENGINES, group="what to run")
    num_prompts: int = option(8, "prompts per text", positive=True, group="what to run")
    prompt_len: int = option(128, "prompt tokens", positive=True, group="what to run")
    max_tokens: int = option(256, "generated tokens per request", positive=True, group="what to run")
    rounds: int = option(3, "times every engine runs every workload", positive=True, group="what to run")
    num_speculative_tokens: int = option(
        7, "n-gram: most tokens proposed a step", positive=True, group=SPEC_GROUP
    )
    prompt_lookup_min: int = option(2, "n-gram: shortest match", positive=True, group=SPEC_GROUP)
    prompt_lookup_max: int = option(5, "n-gram: longest match", positive=True, group=SPEC_GROUP)
    draft_model: str = option(
        "stdlib-llama-draft", "draft model: a folder or a shipped name", group=SPEC_GROUP
    )
    draft_tokens: int = option(3, "draft model: most tokens proposed a step", positive=True, group=SPEC_GROUP)
    model: str | None = option(None, "HF model folder (default: the built-in model)", group="engines")
    dtype: str = option("float32", "", choices=("float32", "bfloat16"), group="engines")
    threads: int = option(1, "CPU threads per engine", positive=True, group="engines")
    llamacpp_python: str | None = option(None, "python of a venv with llama-cpp-python", group="engines")
    llamacpp_convert: str | None = option(
        None, "llama.cpp's convert_hf_to_gguf.py, to make the GGUF on first use", group="engines"
    )
    out: Path = Path(DEFAULT_OUT)

    def __post_init__(self) -> None:
        check_options(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at most prompt_lookup_max")

    def speculative_config(self, engine: str) -> dict | None:
        """The ``speculative_config`` of pagedkv engine ``engine`` (None: no speculation)."""
        if engine == "ngram":
            return {
                "method": "ngram",
                "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max,
            }
        if engine == "draft":
            return {"model": self.draft_model, "num_speculative_tokens": self.draft_tokens}
        return None


@dataclass
class Cell:
    """One engine on one text at one batch size: its runs summed over the rounds."""

    seconds: float = 0.0
    tokens: int = 0
    #: What pagedkv's speculation drafted and accepted (nothing for the other engines).
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    #: generated ids of the first round, per request
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "draft_tokens": self.spec.num_draft_tokens,
            "accepted_tokens": self.spec.num_accepted_tokens,
            "acceptance_rate": self.spec.draft_acceptance_rate,
            "mean_acceptance_length": self.spec.mean_acceptance_length,
        }


@dataclass
class SpecResult:
    config: SpecConfig
    #: (text, batch size, engine) -> its cell
    cells: dict[tuple[str, int, str], Cell] = field(default_factory=dict)
    #: engine -> "ok", or why it did not run (or failed)
    status: dict[str, str] = field(default_factory=dict)
    info: dict[str, dict] = field(default_factory=dict)
    host: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(s.startswith("failed") for s in self.status.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.config).items()},
            "status": self.status,
            "engines": self.info,
            "cells": [
                {"text": text, "batch_size": batch, "engine": engine} | cell.to_json()
                for (text, batch, engine), cell in self.cells.items()
            ],
        }


# -- prompts ---------------------------------------------------------------------------------------
def held_out_texts(kind: str) -> list[str]:
    """Texts the built-in model never trained on: held-out standard-library Python files, or the
    language reference's prose topics (``pydoc_data``, which its training skips)."""
    if kind == "python":
        from pagedkv.models.builtin.train import stdlib_text

        return stdlib_text.read_sources(stdlib_text.split_files()[1])
    import pydoc_data.topics

    return [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]


def prompts_of(kind: str, tokenizer, count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first ``count`` texts of ``kind`` that long."""
    prompts = []
    for text in held_out_texts(kind):
        ids = tokenizer.encode(text)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} {kind} texts have {length} tokens; ask for fewer prompts")


def workloads_of(prompts: list[list[int]], batch: int, max_tokens: int) -> list[Workload]:
    """The prompts in workloads of ``batch`` requests (the last may be smaller)."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    return [Workload(f"batch{batch}", tuple(map(tuple, g)), (max_tokens,) * len(g)) for g in groups]


# -- engines ---------------------------------------------------------------------------------------
class PagedkvSpecEngine:
    """pagedkv's offline ``LLM`` with one speculative_config; ids in, ids out (no tokenizer),
    prefix caching off (every round sends the same prompts)."""

    def __init__(self, config: SpecConfig, speculative_config: dict | None, num_blocks: int) -> None:
        from pagedkv import LLM

        self.llm = LLM(
            config.model,
            dtype=config.dtype,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
            speculative_config=speculative_config,
        )
        self.info = {"runtime": self.llm.engine.describe(), "speculative_config": speculative_config}
        self.last_stats: dict[str, int] = {}

    def run(self, workload: Workload) -> tuple[float, list[list[int]]]:
        from pagedkv import SamplingParams

        verifier = self.llm.engine.verifier
        before = _counts(verifier)
        params = SamplingParams(max_tokens=workload.max_tokens[0], temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([list(p) for p in workload.prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        self.last_stats = {name: now - before[name] for name, now in _counts(verifier).items()}
        return elapsed, [list(o.outputs[0].token_ids) for o in outputs]

    def close(self) -> None:
        self.llm.shutdown()


def _counts(verifier) -> dict[str, int]:
    if verifier is None:
        return {"draft_tokens": 0, "accepted_tokens": 0, "drafts": 0}
    totals = verifier.speculator.totals
    return {
        "draft_tokens": totals.num_draft_tokens,
        "accepted_tokens": totals.num_accepted_tokens,
        "drafts": totals.num_drafts,
    }


def _drafted(stats: dict[str, int]) -> SpecDecodingStats:
    """An engine's ``last_stats`` (pagedkv's and the llama.cpp worker's: ``draft_tokens``,
    ``accepted_tokens``, ``drafts``; none for an engine that does not speculate)."""
    return SpecDecodingStats(
        num_drafts=stats.get("drafts", 0),
        num_draft_tokens=stats.get("draft_tokens", 0),
        num_accepted_tokens=stats.get("accepted_tokens", 0),
    )


def start_engines(config: SpecConfig, model: Path, result: SpecResult) -> dict[str, Any]:
    """Every engine the config names that can run here; why not for the others."""
    largest = max(config.batch_sizes)
    in_flight = largest * (config.prompt_len + config.max_tokens + 16)
    engines: dict[str, Any] = {}
    for name in config.engines:
        progress(f"loading {ENGINE_TITLES[name]}")
        try:
            if name.startswith("llamacpp"):
                engines[name] = _rival(config, model, name == "llamacpp-lookup", largest, in_flight)
            else:
                blocks = blocks_for(in_flight, 16) + largest
                engines[name] = PagedkvSpecEngine(config, config.speculative_config(name), blocks)
        except (EngineUnavailable, ValueError) as err:
            result.status[name] = f"not run: {err}"
            progress(f"  {ENGINE_TITLES[name]}: not run: {err}")
            continue
        result.status[name] = "ok"
        result.info[name] = engines[name].info
    return engines


def _rival(config: SpecConfig, model: Path, lookup: bool, largest: int, in_flight: int) -> RivalEngine:
    if not config.llamacpp_python:
        raise EngineUnavailable("no --llamacpp-python given")
    suffix = {"float32": "f32", "bfloat16": "bf16"}[config.dtype]
    gguf = (config.out / "models" / "gguf" / f"{model.name}-{suffix}.gguf").resolve()
    spec = LoadSpec(
        model, config.dtype, config.threads, largest, in_flight, config.prompt_len + config.max_tokens
    )
    extra: dict[str, Any] = {"gguf": str(gguf), "convert_script": config.llamacpp_convert, "kv_type": "f16"}
    if lookup:
        # llama-cpp-python's proposer with pagedkv's n-gram bounds: its longest match, k tokens
        extra["lookup"] = {
            "max_ngram_size": config.prompt_lookup_max,
            "num_pred_tokens": config.num_speculative_tokens,
        }
    log = config.out / "logs" / f"{'llamacpp-lookup' if lookup else 'llamacpp'}-{config.dtype}.log"
    return RivalEngine("llamacpp", config.llamacpp_python, spec, log, extra)


# -- the run ---------------------------------------------------------------------------------------
def run_spec(config: SpecConfig) -> SpecResult:
    import torch

    from pagedkv.models import builtin_model_path
    from pagedkv.tokenizer import engine_tokenizer

    model = Path(config.model) if config.model else builtin_model_path()
    result = SpecResult(config)
    tokenizer = engine_tokenizer(model, False)
    prompts = {
        kind: prompts_of(kind, tokenizer, config.num_prompts, config.prompt_len) for kind in config.texts
    }
    with run_settings(config.threads):
        result.host = host_state("start") | {"torch": torch.__version__}
        engines = start_engines(config, model, result)
        try:
            for text in config.texts:
                for batch in config.batch_sizes:
                    _run_cell(
                        result, engines, text, batch, workloads_of(prompts[text], batch, config.max_tokens)
                    )
        finally:
            for engine in engines.values():
                engine.close()
        result.host |= host_state("end")
    return result


def _run_cell(
    result: SpecResult, engines: dict[str, Any], text: str, batch: int, workloads: list[Workload]
) -> None:
    """Every engine runs every workload, in turn, round after round."""
    for engine in engines.values():
        engine.run(workloads[0])  # its first run of this shape warms it up, untimed
    for round_index in range(result.config.rounds):
        for workload in workloads:
            for name, engine in list(engines.items()):
                cell = result.cells.setdefault((text, batch, name), Cell())
                try:
                    elapsed, token_ids = engine.run(workload)
                except EngineUnavailable as err:
                    result.status[name] = f"failed: {err}"
                    progress(f"{ENGINE_TITLES[name]} failed: {err}")
                    engines.pop(name).close()
                    continue
                cell.seconds += elapsed
                cell.tokens += sum(len(t) for t in token_ids)
                cell.spec.merge(_drafted(getattr(engine, "last_stats", {})))
                if round_index == 0:
                    cell.outputs += token_ids
        progress(
            f"[{text}, batch {batch}] round {round_index + 1}/{result.config.rounds}: "
            + ", ".join(
                f"{name} {result.cells[text, batch, name].tokens_per_s or 0:,.0f} tok/s"
                for name in engines
                if (text, batch, name) in result.cells
            )
        )
