"""``pagedkv bench quality``: what a KV cache dtype costs in quality, on a model that learned something.

The built-in model is trained on the Python standard library; its held-out files are text it
never saw (:mod:`pagedkv.models.training.stdlib_text`). For each KV cache dtype, one engine --
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

The configuration is in :mod:`~pagedkv.bench.quality_config`, the table in ``quality_report``
and the command line in ``quality_cli``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedkv.bench.driver import EngineOptions, run_settings
from pagedkv.bench.quality_config import QualityConfig
from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.engine.executor import Executor, StepPlan
from pagedkv.engine.perplexity import Perplexity, run_to_completion, sliding_windows, window_logprobs
from pagedkv.models import ModelConfig, builtin_model_path, load_tokenizer
from pagedkv.models.training import stdlib_text


class LogitsTap(Executor):
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

    def check_health(self) -> None:
        self.inner.check_health()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def logits(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.empty(0)


@dataclass
class HeldOut:
    """The held-out text: its files, their token ids (BOS first, EOS last, as in training)."""

    files: list[str]
    chars: int
    documents: list[list[int]]

    @classmethod
    def load(cls, model: str | None, max_chars: int | None) -> HeldOut:
        """The first ``max_chars`` characters of the held-out files (None: all of them; the last
        file read may be cut) as ``model``'s tokenizer encodes them (None: the built-in model's)."""
        path = builtin_model_path() if model is None else Path(model)
        tokenizer, eos = load_tokenizer(path), ModelConfig.from_pretrained(path).eos_token_ids[0]
        _, heldout_files = stdlib_text.split_files()
        files, texts, total = [], [], 0
        for relpath in heldout_files:
            if max_chars is not None and total >= max_chars:
                break
            (text,) = stdlib_text.read_sources([relpath])
            text = text if max_chars is None else text[: max_chars - total]
            files.append(relpath)
            texts.append(text)
            total += len(text)
        return cls(files, total, [tokenizer.encode(text) + [eos] for text in texts])

    def prompts(self, count: int, length: int) -> list[list[int]]:
        """``count`` prompts of ``length`` tokens, evenly spaced over the held-out documents'
        consecutive ``length``-token pieces (fewer if there are fewer pieces)."""
        pieces = [
            ids[i : i + length] for ids in self.documents for i in range(0, len(ids) - length + 1, length)
        ]
        if len(pieces) <= count:
            return pieces
        return [pieces[i * len(pieces) // count] for i in range(count)]


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
    perplexity_change_pct: float | None
    #: Generated positions where the greedy token equals auto's, as a fraction.
    token_agreement: float | None
    #: Mean index of the first generated token that differs from auto's (gen_tokens if none).
    first_divergence_mean: float | None
    identical_continuations: int | None
    logits_max_abs_error: float | None
    logits_mean_abs_error: float | None
    seconds: float


@dataclass
class QualityResult:
    config: QualityConfig
    options: EngineOptions
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
        return {
            "config": asdict(self.config),
            "engine": asdict(self.options),
            "heldout": {
                "files": self.heldout_files,
                "chars": self.heldout_chars,
                "scored_tokens": self.scored_tokens,
                "windows": self.num_windows,
            },
            "agreement_prompts": self.num_prompts,
            "logits_rows_compared": self.logits_rows,
            "rows": [asdict(row) for row in self.rows],
            "ok": self.ok,
        }


def quality_engine(options: EngineOptions, config: QualityConfig, kv_cache_dtype: str) -> LLMEngine:
    """An engine of ``options`` with the run's pool and context; its KV cache in ``kv_cache_dtype``."""
    options = dataclasses.replace(options, kv_cache_dtype=kv_cache_dtype)
    return LLMEngine(options.engine_config(config.num_kv_blocks, config.max_model_len))


def run_dtype(
    options: EngineOptions, config: QualityConfig, kv_cache_dtype: str, heldout: HeldOut
) -> DtypeRun:
    """Perplexity (with the logits tapped), then the greedy continuations, on a fresh engine."""
    started = time.perf_counter()
    engine = quality_engine(options, config, kv_cache_dtype)
    tap = LogitsTap(engine.executor, config.logits_rows)
    engine.executor = tap  # the engine's seam to the model: observed, not changed
    windows = [w for ids in heldout.documents for w in sliding_windows(ids, config.window, config.stride)]
    perplexity = Perplexity.of(window_logprobs(engine, windows))
    engine.executor = tap.inner
    greedy = SamplingParams(max_tokens=config.gen_tokens, temperature=0.0, ignore_eos=True)
    outputs = run_to_completion(engine, heldout.prompts(config.num_prompts, config.prompt_len), greedy)
    generated = [out.outputs[0].token_ids for out in outputs]
    bytes_per_token = engine.kv_stats()["bytes_per_token"]
    engine.shutdown()
    seconds = time.perf_counter() - started
    return DtypeRun(
        kv_cache_dtype, bytes_per_token, perplexity, generated, tap.logits(), tap.token_ids, seconds
    )


def compare(run: DtypeRun, reference: DtypeRun) -> QualityRow:
    """``run``'s row of the table, against ``reference`` (auto)."""
    ppl = run.perplexity.perplexity
    if run is reference:
        return QualityRow(
            run.kv_cache_dtype, run.bytes_per_token, ppl, None, None, None, None, None, None, run.seconds
        )
    if run.logits_token_ids != reference.logits_token_ids:
        raise RuntimeError(
            f"{run.kv_cache_dtype}: its logits rows are not auto's tokens (scheduling differed)"
        )
    error = (run.logits - reference.logits).abs()
    matches, divergence, identical = [], [], 0
    for ours, theirs in zip(run.generated, reference.generated, strict=True):
        same = [a == b for a, b in zip(ours, theirs, strict=True)]
        matches.append(sum(same) / len(same))
        divergence.append(same.index(False) if False in same else len(same))
        identical += all(same)
    return QualityRow(
        kv_cache_dtype=run.kv_cache_dtype,
        bytes_per_token=run.bytes_per_token,
        perplexity=ppl,
        perplexity_change_pct=100 * (ppl / reference.perplexity.perplexity - 1),
        token_agreement=sum(matches) / len(matches) if matches else math.nan,
        first_divergence_mean=sum(divergence) / len(divergence) if divergence else math.nan,
        identical_continuations=identical,
        logits_max_abs_error=error.max().item() if error.numel() else math.nan,
        logits_mean_abs_error=error.mean().item() if error.numel() else math.nan,
        seconds=run.seconds,
    )


def run_quality(options: EngineOptions, config: QualityConfig, progress: bool = False) -> QualityResult:
    """Every dtype of ``config`` in turn, ``auto`` first; the table's rows against it."""
    with run_settings(options.threads):
        heldout = HeldOut.load(options.model, config.max_heldout_chars)
        runs: list[DtypeRun] = []
        for kv_cache_dtype in config.dtypes:
            if progress:
                print(f"kv_cache_dtype={kv_cache_dtype} ...", flush=True)
            runs.append(run_dtype(options, config, kv_cache_dtype, heldout))
    reference = runs[0]
    return QualityResult(
        config=config,
        options=options,
        heldout_files=len(heldout.files),
        heldout_chars=heldout.chars,
        scored_tokens=reference.perplexity.num_tokens,
        num_windows=reference.perplexity.num_windows,
        num_prompts=len(reference.generated),
        logits_rows=len(reference.logits_token_ids),
        rows=[compare(run, reference) for run in runs],
    )
