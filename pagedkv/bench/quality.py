"""``pagedkv bench quality``: what a KV cache dtype costs in quality, on a model that learned something.

The built-in model is trained on the Python standard library; its held-out files are text it
never saw (:mod:`pagedkv.models.builtin.train.stdlib_text`). For each KV cache dtype, one engine --
same model, same pool of blocks, same scheduling; only the cache's storage differs -- computes:

1. **perplexity** of the held-out files through the paged path (prompt logprobs,
   :mod:`pagedkv.engine.perplexity`), in the training script's windows by default, so ``auto``
   in float32 reproduces the training script's held-out figure;
2. **the logits' error**: the executor's logits for the first rows of those windows, against
   ``auto``'s for the same rows (the pools are the same size and the scheduler deterministic, so
   step ``i`` of every engine computes the same tokens; checked, not assumed);
3. **greedy agreement**: prompts cut from held-out files, each continued by greedy tokens (EOS
   ignored), compared position by position with ``auto``'s continuation -- once two
   continuations part, the later positions mostly differ too, so the first divergence is given
   as well.

``--text FILE`` scores a text file instead (tokenized whole, as ``llama-perplexity -f`` does), and
``--llamacpp-chunks`` cuts it as ``llama-perplexity -c WINDOW`` does
(:func:`pagedkv.engine.perplexity.llamacpp_chunks`): a GGUF model's figure then stands beside
llama.cpp's on the same file, text and windows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from pagedkv.bench.driver import EngineOptions, cell, print_checks, progress, run_settings, table
from pagedkv.bench.options import check_options, option
from pagedkv.bench.quality_text import HeldOut
from pagedkv.engine import SamplingParams
from pagedkv.engine.perplexity import (
    Perplexity,
    Window,
    llamacpp_chunks,
    run_to_completion,
    sliding_windows,
    window_logprobs,
)
from pagedkv.memory.kv_bytes import KV_CACHE_DTYPE_NAMES

if TYPE_CHECKING:
    import torch

    from pagedkv.engine import LLMEngine
    from pagedkv.engine.worker.executor import Executor, StepPlan

#: The reference every other KV cache dtype is compared with: the model's own dtype.
REFERENCE = "auto"
TEXT, GREEDY = "held-out text", "greedy agreement"


@dataclass(frozen=True)
class QualityConfig:
    """Perplexity of the held-out files (``max_heldout_chars`` of them; None: all) in windows of
    ``window`` tokens every ``stride`` (None: ``window``), the first ``logits_rows`` logits rows
    against ``auto``'s, and ``num_prompts`` greedy continuations. Every engine has the same pool
    (``num_kv_blocks``), so each is scheduled alike and the logits rows line up."""

    kv_cache_dtypes: tuple[str, ...] = option(
        KV_CACHE_DTYPE_NAMES,
        "KV cache dtypes; auto (the reference) always runs",
        choices=KV_CACHE_DTYPE_NAMES,
    )
    goal_pct: float = option(1.0, "most perplexity rise over auto, in %% (exit status 1 above it)")
    max_heldout_chars: int | None = option(
        None,
        "read held-out files up to this many characters (default: all, ~1.1 M characters, ~345 k tokens)",
        positive=True,
        group=TEXT,
    )
    window: int = option(256, "perplexity window", positive=True, group=TEXT)
    stride: int | None = option(
        None, "window stride; smaller: sliding windows (default: --window)", group=TEXT
    )
    text: str | None = option(
        None,
        "score this UTF-8 text file, tokenized whole, instead of the held-out files",
        group=TEXT,
        metavar="FILE",
    )
    llamacpp_chunks: bool = option(
        False,
        "llama-perplexity's windows: consecutive chunks of --window tokens, each scoring its second half",
        group=TEXT,
    )
    logits_rows: int = option(8192, "logits rows compared", positive=True, group=TEXT)
    num_prompts: int = option(8, "prompts", positive=True, group=GREEDY)
    prompt_len: int = option(128, "prompt tokens", positive=True, group=GREEDY)
    gen_tokens: int = option(256, "greedy tokens per prompt", positive=True, group=GREEDY)
    num_kv_blocks: int = 2048
    engine: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        check_options(self)
        if self.window < 2:
            raise ValueError(f"window must hold at least 2 tokens, got {self.window}")
        if self.stride is not None and not 1 <= self.stride <= self.window:
            raise ValueError(f"stride must be in [1, window = {self.window}], got {self.stride!r}")
        if self.llamacpp_chunks and self.stride is not None:
            raise ValueError("llamacpp_chunks are consecutive chunks: they take no stride")
        if self.text is not None and self.max_heldout_chars is not None:
            raise ValueError("max_heldout_chars cuts the held-out files: it does not apply to text")
        if not self.goal_pct >= 0:
            raise ValueError(f"goal_pct must be >= 0, got {self.goal_pct!r}")

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes to run, ``auto`` first (the others are compared with it)."""
        return (REFERENCE, *(d for d in self.kv_cache_dtypes if d != REFERENCE))

    @property
    def max_model_len(self) -> int:
        """Context of every engine: a window plus its one generated token, a prompt plus its output."""
        return max(self.window + 1, self.prompt_len + self.gen_tokens)

    def windows(self, heldout: HeldOut) -> list[Window]:
        """The perplexity windows of ``heldout``'s documents (never across two)."""
        if self.llamacpp_chunks:
            return [w for ids in heldout.documents for w in llamacpp_chunks(ids, self.window, heldout.bos)]
        return [w for ids in heldout.documents for w in sliding_windows(ids, self.window, self.stride)]

    def load_text(self) -> HeldOut:
        """The text scored: ``text`` if given, else the held-out files."""
        if self.text is not None:
            return HeldOut.from_file(self.engine.model, Path(self.text))
        return HeldOut.load(self.engine.model, self.max_heldout_chars)


class LogitsTap:
    """An executor that hands every call to ``inner`` and keeps the first ``max_rows`` logits rows
    it returns, with the token each row was computed at (to prove two runs' rows line up)."""

    def __init__(self, inner: Executor, max_rows: int) -> None:
        self.inner = inner
        self.num_kv_blocks = inner.num_kv_blocks
        self.kv_memory = inner.kv_memory
        self.max_rows = max_rows
        self.rows: list[torch.Tensor] = []
        self.token_ids: list[int] = []

    def execute(self, plan: StepPlan) -> torch.Tensor:
        logits = self.inner.execute(plan)
        room = self.max_rows - len(self.token_ids)
        if room > 0:
            tokens = [piece.token_ids[row] for piece in plan.slices for row in piece.logits_rows()]
            self.rows.append(logits[:room].clone())
            self.token_ids.extend(tokens[:room])
        return logits

    def adapter_failures(self) -> dict[int, str]:
        return self.inner.adapter_failures()

    def check_health(self) -> None:
        self.inner.check_health()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def logits(self) -> torch.Tensor:
        import torch

        return torch.cat(self.rows) if self.rows else torch.empty(0)


@dataclass
class DtypeRun:
    """One KV cache dtype's raw results."""

    kv_cache_dtype: str
    #: KV cache bytes per token, scales included (``kv_stats()["bytes_per_token"]``).
    bytes_per_token: int
    perplexity: Perplexity
    generated: list[list[int]]
    logits: torch.Tensor
    logits_token_ids: list[int]
    seconds: float


@dataclass
class QualityRow:
    """One KV cache dtype against ``auto`` (the comparisons are None on ``auto``'s own row)."""

    kv_cache_dtype: str
    bytes_per_token: int
    perplexity: float
    seconds: float
    perplexity_change_pct: float | None = None
    #: Generated positions where the greedy token equals auto's, as a fraction.
    token_agreement: float | None = None
    #: Mean index of the first generated token that differs from auto's (gen_tokens if none).
    first_divergence_mean: float | None = None
    identical_continuations: int | None = None
    logits_max_abs_error: float | None = None
    logits_mean_abs_error: float | None = None


@dataclass
class QualityResult:
    config: QualityConfig
    heldout_files: int
    heldout_chars: int
    scored_tokens: int
    num_windows: int
    num_prompts: int
    logits_rows: int
    rows: list[QualityRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every dtype's perplexity within the goal over auto's."""
        changes = [r.perplexity_change_pct for r in self.rows if r.perplexity_change_pct is not None]
        return all(change <= self.config.goal_pct for change in changes)

    def to_json(self) -> dict:
        heldout = ("files", "chars", "scored_tokens", "windows")
        figures = (self.heldout_files, self.heldout_chars, self.scored_tokens, self.num_windows)
        return {
            "config": asdict(self.config),
            "heldout": dict(zip(heldout, figures, strict=True)),
            "agreement_prompts": self.num_prompts,
            "logits_rows_compared": self.logits_rows,
            "rows": [asdict(row) for row in self.rows],
            "ok": self.ok,
        }


def quality_engine(config: QualityConfig, kv_cache_dtype: str) -> LLMEngine:
    """An engine of the config's options, pool and context; its KV cache in ``kv_cache_dtype``."""
    from pagedkv.engine import LLMEngine

    options = dataclasses.replace(config.engine, kv_cache_dtype=kv_cache_dtype)
    return LLMEngine(options.engine_config(config.num_kv_blocks, config.max_model_len))


def run_dtype(config: QualityConfig, kv_cache_dtype: str, heldout: HeldOut) -> DtypeRun:
    """Perplexity (with the logits tapped), then the greedy continuations, on a fresh engine."""
    started = time.perf_counter()
    engine = quality_engine(config, kv_cache_dtype)
    tap = LogitsTap(engine.executor, config.logits_rows)
    engine.executor = tap  # the engine's seam to the model: observed, not changed
    perplexity = Perplexity.of(window_logprobs(engine, config.windows(heldout)))
    engine.executor = tap.inner
    greedy = SamplingParams(max_tokens=config.gen_tokens, temperature=0.0, ignore_eos=True)
    outputs = run_to_completion(engine, heldout.prompts(config.num_prompts, config.prompt_len), greedy)
    bytes_per_token = engine.kv_stats()["bytes_per_token"]
    engine.shutdown()
    generated = [out.outputs[0].token_ids for out in outputs]
    seconds = time.perf_counter() - started
    return DtypeRun(
        kv_cache_dtype, bytes_per_token, perplexity, generated, tap.logits(), tap.token_ids, seconds
    )


def compare(run: DtypeRun, reference: DtypeRun) -> QualityRow:
    """``run``'s row of the table, against ``reference`` (auto)."""
    row = QualityRow(run.kv_cache_dtype, run.bytes_per_token, run.perplexity.perplexity, run.seconds)
    if run is reference:
        return row
    if run.logits_token_ids != reference.logits_token_ids:
        raise RuntimeError(
            f"{run.kv_cache_dtype}: its logits rows are not auto's tokens (scheduling differed)"
        )
    error = (run.logits - reference.logits).abs()
    matches, divergence = [], []
    for ours, theirs in zip(run.generated, reference.generated, strict=True):
        same = [a == b for a, b in zip(ours, theirs, strict=True)]
        matches.append(sum(same) / len(same))
        divergence.append(same.index(False) if False in same else len(same))
    return dataclasses.replace(
        row,
        perplexity_change_pct=100 * (row.perplexity / reference.perplexity.perplexity - 1),
        token_agreement=sum(matches) / len(matches) if matches else math.nan,
        first_divergence_mean=sum(divergence) / len(divergence) if divergence else math.nan,
        identical_continuations=sum(d == len(g) for d, g in zip(divergence, run.generated, strict=True)),
        logits_max_abs_error=error.max().item() if error.numel() else math.nan,
        logits_mean_abs_error=error.mean().item() if error.numel() else math.nan,
    )


def run_quality(config: QualityConfig) -> QualityResult:
    """Every dtype of ``config`` in turn, ``auto`` first; the table's rows against it."""
    with run_settings(config.engine.threads):
        heldout = config.load_text()
        runs = []
        for kv_cache_dtype in config.dtypes:
            progress(f"quality: kv_cache_dtype={kv_cache_dtype}")
            runs.append(run_dtype(config, kv_cache_dtype, heldout))
    reference = runs[0]
    return QualityResult(
        config=config,
        heldout_files=len(heldout.files),
        heldout_chars=heldout.chars,
        scored_tokens=reference.perplexity.num_tokens,
        num_windows=reference.perplexity.num_windows,
        num_prompts=len(reference.generated),
        logits_rows=len(reference.logits_token_ids),
        rows=[compare(run, reference) for run in runs],
    )


def print_quality(result: QualityResult, console: Console) -> None:
    """One row per KV cache dtype, what the columns mean, and the perplexity goal."""
    from pagedkv.models import BUILTIN_NOTE

    config, engine = result.config, result.config.engine
    windows = f"windows of {config.window}" + (f" every {config.stride}" if config.stride else "")
    if config.llamacpp_chunks:
        windows = f"llama-perplexity's chunks of {config.window}, second halves scored"
    source = f"{result.heldout_files} stdlib files never trained on" if config.text is None else config.text
    console.print(
        f"[bold]KV cache dtype vs quality[/] -- {BUILTIN_NOTE if engine.model is None else engine.model}; "
        f"model dtype {engine.dtype}, quantized activations {engine.quantized_activations}.\n"
        f"Perplexity: {result.scored_tokens:,} held-out tokens "
        f"({source}, {windows}). Logits error: the first "
        f"{result.logits_rows:,} rows of those windows vs auto. Greedy: {result.num_prompts} held-out "
        f"prompts of {config.prompt_len} tokens, {config.gen_tokens} tokens each, vs auto."
    )
    columns = ("KV", "B/tok", "ppl", "vs auto", "agree", "1st diff", "same", "max err", "mean err")
    rows = table(None, columns, no_wrap=True, show_edge=False, pad_edge=False)
    for row in result.rows:
        same = row.identical_continuations
        rows.add_row(
            row.kv_cache_dtype,
            f"{row.bytes_per_token:,}",
            f"{row.perplexity:.3f}",
            cell(row.perplexity_change_pct, "+.2f", "%"),
            cell(row.token_agreement, ".1%"),
            cell(row.first_divergence_mean, ".0f"),
            "-" if same is None else f"{same}/{result.num_prompts}",
            cell(row.logits_max_abs_error, ".4f"),
            cell(row.logits_mean_abs_error, ".5f"),
        )
    console.print(rows)
    console.print(
        "B/tok: KV cache bytes per token, scales included; agree: generated positions whose greedy "
        "token equals auto's; 1st diff: mean position of the first token that differs (continuations "
        "that part seldom meet again); same: continuations identical to auto's; max / mean err: "
        "absolute logit difference from auto."
    )
    print_checks(
        console, [(f"perplexity within +{config.goal_pct:g} % of auto for every KV cache dtype", result.ok)]
    )
