"""The tables of ``pagedkv bench spec``: tokens/s per engine, text and batch size, the ratios the
speculative decoding issue sets goals for, acceptance, and whether greedy outputs agree."""

from __future__ import annotations

from rich.console import Console

from pagedkv.bench.driver import cell, print_checks, table
from pagedkv.bench.spec import ENGINE_TITLES, ENGINES, Cell, SpecResult

#: The goals for speculation on the built-in model: single stream writing Python, n-gram
#: against none and against llama.cpp's single stream on the same weights.
SPEEDUP_GOAL = 1.8
RIVAL_GOAL = 1.5


def ratio(result: SpecResult, text: str, batch: int, engine: str, against: str) -> float | None:
    """``engine``'s tokens/s over ``against``'s on ``text`` at ``batch`` (None if either is missing)."""
    mine, theirs = result.cells.get((text, batch, engine)), result.cells.get((text, batch, against))
    if mine is None or theirs is None or not mine.tokens_per_s or not theirs.tokens_per_s:
        return None
    return mine.tokens_per_s / theirs.tokens_per_s


def fastest_llamacpp(result: SpecResult, text: str, batch: int) -> str | None:
    """The faster of llama.cpp's two modes there (the stricter comparison), or None."""
    ran = [
        e for e in ("llamacpp", "llamacpp-lookup") if (result.cells.get((text, batch, e)) or Cell()).tokens
    ]
    return max(ran, key=lambda e: result.cells[text, batch, e].tokens_per_s) if ran else None


def agreement(result: SpecResult, text: str, batch: int, engine: str) -> str:
    """How many of ``engine``'s greedy outputs equal pagedkv's without speculation."""
    mine, base = result.cells.get((text, batch, engine)), result.cells.get((text, batch, "off"))
    if mine is None or base is None or not base.outputs:
        return "-"
    same = sum(a == b for a, b in zip(mine.outputs, base.outputs, strict=False))
    return f"{same}/{len(base.outputs)}"


def print_spec(result: SpecResult, console: Console) -> None:
    config = result.config
    for engine, status in result.status.items():
        if status != "ok":
            console.print(f"{ENGINE_TITLES[engine]}: {status}")
    columns = ("engine", "tok/s", "x no spec", "x llama.cpp", "acc. rate", "mean acc. len", "same ids")
    for text in config.texts:
        for batch in config.batch_sizes:
            title = "single stream" if batch == 1 else f"batch {batch}"
            rows = table(f"{text}, {title}", columns)
            for engine in (e for e in ENGINES if e in config.engines):
                got = result.cells.get((text, batch, engine)) or Cell()
                rows.add_row(
                    ENGINE_TITLES[engine],
                    cell(got.tokens_per_s),
                    cell(ratio(result, text, batch, engine, "off"), ".2f", "x"),
                    cell(ratio(result, text, batch, engine, "llamacpp"), ".2f", "x"),
                    cell(got.spec.draft_acceptance_rate, ".2f"),
                    cell(got.spec.mean_acceptance_length, ".2f"),
                    agreement(result, text, batch, engine),
                )
            console.print(rows)
    console.print(
        f"{config.num_prompts} prompts of {config.prompt_len} tokens per text, {config.max_tokens} greedy "
        f"tokens each, {config.rounds} rounds, {config.threads} thread(s) per engine, {config.dtype}"
    )
    _print_goals(result, console)


def _print_goals(result: SpecResult, console: Console) -> None:
    if "python" not in result.config.texts or 1 not in result.config.batch_sizes:
        return
    checks = []
    speedup = ratio(result, "python", 1, "ngram", "off")
    if speedup is not None:
        checks.append(
            (
                f"single stream, Python: n-gram {speedup:.2f}x no speculation (goal {SPEEDUP_GOAL}x)",
                speedup >= SPEEDUP_GOAL,
            )
        )
    rival = fastest_llamacpp(result, "python", 1)
    versus = ratio(result, "python", 1, "ngram", rival) if rival else None
    if versus is not None:
        label = f"single stream, Python: n-gram {versus:.2f}x {ENGINE_TITLES[rival]} (goal {RIVAL_GOAL}x)"
        checks.append((label, versus >= RIVAL_GOAL))
    if checks:
        console.print("Goals (issue: speculative decoding):")
        print_checks(console, checks)
