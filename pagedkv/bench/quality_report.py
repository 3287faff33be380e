"""The table of ``pagedkv bench quality``: each KV cache dtype against ``auto``."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from pagedkv.bench.quality import QualityResult
from pagedkv.models import BUILTIN_NOTE


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_quality(result: QualityResult, console: Console) -> None:
    """One row per KV cache dtype, what the columns mean, and the perplexity goal."""
    config, options = result.config, result.options
    model = BUILTIN_NOTE if options.model is None else options.model
    windows = f"windows of {config.window}" + (f" every {config.stride}" if config.stride else "")
    console.print(
        f"[bold]KV cache dtype vs quality[/] -- {model}; model dtype {options.dtype}.\n"
        f"Perplexity: {result.scored_tokens:,} held-out tokens ({result.heldout_files} stdlib files never "
        f"trained on, {windows}). Logits error: the first {result.logits_rows:,} rows of those windows "
        f"vs auto. Greedy: {result.num_prompts} held-out prompts of {config.prompt_len} tokens, "
        f"{config.gen_tokens} tokens each, vs auto."
    )
    table = Table(show_edge=False, pad_edge=False)
    columns = ("KV", "B/tok", "ppl", "vs auto", "agree", "1st diff", "same", "max err", "mean err")
    for title in columns:
        table.add_column(title, justify="left" if title == "KV" else "right", no_wrap=True)
    for row in result.rows:
        change, agreement, same = row.perplexity_change_pct, row.token_agreement, row.identical_continuations
        table.add_row(
            row.kv_cache_dtype,
            f"{row.bytes_per_token:,}",
            f"{row.perplexity:.3f}",
            "-" if change is None else f"{change:+.2f}%",
            "-" if agreement is None else f"{agreement:.1%}",
            _num(row.first_divergence_mean, ".0f"),
            "-" if same is None else f"{same}/{result.num_prompts}",
            _num(row.logits_max_abs_error, ".4f"),
            _num(row.logits_mean_abs_error, ".5f"),
        )
    console.print(table)
    console.print(
        "B/tok: KV cache bytes per token, scales included; agree: generated positions whose greedy "
        "token equals auto's; 1st diff: mean position of the "
        "first token that differs (continuations that part seldom meet again); same: continuations "
        "identical to auto's; max / mean err: absolute logit difference from auto."
    )
    mark = "[green]met[/]" if result.ok else "[red]NOT met[/]"
    console.print(f"  {mark}  perplexity within +{config.goal_pct:g} % of auto for every KV cache dtype")
