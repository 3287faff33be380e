"""Tables of ``pagedkv bench sharing``: what was measured, next to the paper's figures."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from pagedkv.bench.driver import mean
from pagedkv.bench.sharing import SharingResult, parallel_saving_once_done
from pagedkv.bench.sharing_config import PAPER_SAVING
from pagedkv.memory import blocks_for
from pagedkv.models import BUILTIN_NOTE


def _pct(value: float) -> str:
    return f"{value:.1%}" if math.isfinite(value) else "-"


def _mark(ok: bool) -> str:
    return "[green]met[/]" if ok else "[red]NOT met[/]"


def print_sharing(result: SharingResult, console: Console) -> None:
    """Both experiments' tables, what they mean, and the checks."""
    options = result.options
    model = BUILTIN_NOTE if options.model is None else options.model
    console.print(
        f"[bold]KV sharing in the live engine[/] -- {model}; block size {options.run_block_size}"
        + (f" (every length / {options.scale})" if options.scale > 1 else "")
        + ". KV use is sampled while each forward pass runs; averages are per engine step."
    )
    if result.prefix:
        print_prefix(result, console)
    if result.forks:
        print_forks(result, console)
    checks = []
    if result.prefix:
        checks.append(("greedy outputs identical with prefix caching on and off", result.outputs_identical))
    checks.append(("every block back in the pool after each run", result.blocks_returned))
    if result.forks:
        widths = sorted({r.width for r in result.forks})
        beats = all(result.fork("beam", w).saving > result.fork("parallel", w).saving for w in widths)
        checks.append(("beams save more than parallel samples at every width", beats))
    for label, ok in checks:
        console.print(f"  {_mark(ok)}  {label}")
    console.print(f"wall time {result.wall_s:.1f} s")


def print_prefix(result: SharingResult, console: Console) -> None:
    first = result.prefix[0]
    config = result.prefix_config
    title = (
        f"Shared system prompt: N requests of S common + {first.user_len} unique prompt tokens, "
        f"{first.output_len} greedy output tokens, all submitted at once"
        + (" after one warm-up request" if config is not None and config.warm else "")
        + "; prefix caching on / off"
    )
    # Two narrow tables rather than one wide one: they must read in an 80-column terminal.
    memory = Table(title=title + " -- KV blocks held")
    compute = Table(
        title="... and the prefill work",
        caption="cold: requests that computed the prefix themselves; TTFT: each engine's own clock",
    )
    for name in ("S", "N", "peak on/off", "saved", "mean on/off"):
        memory.add_column(name, justify="right")
    for name in ("S", "N", "computed on/off", "skipped", "cold", "TTFT on/off (s)", "same output"):
        compute.add_column(name, justify="right")
    for p in result.prefix:
        on, off = p.on, p.off
        memory.add_row(
            str(p.prefix_len),
            str(p.num_requests),
            f"{on.peak_blocks}/{off.peak_blocks}",
            _pct(p.blocks_saved),
            f"{on.mean_blocks:.0f}/{off.mean_blocks:.0f}",
        )
        compute.add_row(
            str(p.prefix_len),
            str(p.num_requests),
            f"{on.prefill_computed}/{off.prefill_computed}",
            str(on.prefill_skipped),
            f"{p.cold_requests}/{p.num_requests}",
            f"{on.ttft_mean:.2f}/{off.ttft_mean:.2f}",
            "yes" if p.outputs_identical else "[red]NO[/]",
        )
    console.print(memory)
    console.print(compute)
    if config is not None and config.warm:
        console.print(
            "A warm-up request with the same system prompt ran first (not counted): every measured "
            "request finds the prefix cached and computes only its own part, plus the last prefix "
            "block's tokens when S is not a whole number of blocks."
        )
    else:
        console.print(
            "Submitted at once, the requests admitted in the first step (as many as its token budget "
            "holds) all compute the prefix ('cold'): a block is offered to other requests only once a "
            "step has computed it (vLLM v1 offers it when scheduled, so there the first step's later "
            "requests would hit too). Their duplicate blocks are merged after that step, which the "
            "peak shows and the mean hardly does; every later request computes only its own tokens. "
            "--warm sends one request first: the steady state of a server that has seen the prompt."
        )


def print_forks(result: SharingResult, console: Console) -> None:
    config, options = result.fork_config, result.options
    lengths = config.lengths(options.scale)
    bs = options.run_block_size
    prompt_mean = mean([p for p, _ in lengths])
    output_mean = mean([o for _, o in lengths])
    paper = PAPER_SAVING[config.mix]
    table = Table(
        title=f"Parallel sampling and beam search: {config.num_prompts} '{config.mix}' prompts (mean "
        f"{prompt_mean:.0f} prompt + {output_mean:.0f} output tokens), KV blocks shared (copy-on-write) "
        "vs each sample or beam a private copy",
        caption="saved = 1 - blocks held / blocks without sharing, time-averaged over engine steps; "
        "once done: parallel samples at their final lengths; paper: the PagedAttention paper's range",
    )
    for name in ("mode", "n/width", "peak shared/private", "saved", "at peak", "once done", "paper"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for run in result.forks:
        figures = run.figures()
        low, high = paper[run.kind]
        once_done = parallel_saving_once_done(lengths, bs, run.width) if run.kind == "parallel" else math.nan
        table.add_row(
            "samples" if run.kind == "parallel" else "beams",
            str(run.width),
            f"{figures['peak_blocks']}/{figures['peak_blocks_without_sharing']}",
            _pct(run.saving),
            _pct(run.peak_saving),
            _pct(once_done),
            f"{low:.1%}-{high:.1%}",
        )
    console.print(table)
    console.print(_fork_explanation(result, lengths, prompt_mean, output_mean))


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return _pct(low) if low == high else f"{_pct(low)}-{_pct(high)}"


def _compare(values: list[float], low: float, high: float) -> str:
    if all(low <= v <= high for v in values):
        return "within"
    if all(v > high for v in values):
        return "above"
    if all(v < low for v in values):
        return "below"
    return "overlapping"


def _fork_explanation(
    result: SharingResult, lengths: list[tuple[int, int]], prompt_mean: float, output_mean: float
) -> str:
    config, bs = result.fork_config, result.options.run_block_size
    paper = PAPER_SAVING[config.mix]
    parallel = [r.saving for r in result.forks if r.kind == "parallel"]
    beam = [r.saving for r in result.forks if r.kind == "beam"]
    full = mean([p // bs for p, _ in lengths])
    blocks = mean([blocks_for(p + o, bs) for p, o in lengths])
    text = (
        f"Parallel samples share only their prompt's full blocks: the partial last block is copied on "
        f"the first write and every generated token is private. Here a prompt has {full:.1f} full "
        f"{bs}-token blocks of the {blocks:.1f} a sample holds at the end, so once done n samples save "
        f"(n-1)/n of that share ('parallel once done'); the time average is higher because earlier "
        f"the prompt is a larger part of every table. Beams share more: they also "
        f"share what they generated, since a beam chosen twice forks and a dropped beam's blocks go "
        f"back at once, so a request's beams hold one common history and short private tails."
    )
    if parallel:
        text += (
            f" Parallel sampling saved {_span(parallel)}, "
            f"{_compare(parallel, *paper['parallel'])} the paper's {paper['parallel'][0]:.1%}-"
            f"{paper['parallel'][1]:.1%}"
        )
    if beam:
        text += (
            f"; beam search {_span(beam)}, {_compare(beam, *paper['beam'])} "
            f"its {paper['beam'][0]:.1%}-{paper['beam'][1]:.1%}."
        )
    weights = "the built-in model's" if result.options.model is None else "these"
    text += (
        f" The paper measured OPT-13B serving a stream of {config.mix}-length requests; here one batch "
        f"of {config.num_prompts} prompts runs with ignore_eos on {weights} weights, prompts averaging "
        f"{prompt_mean:.0f} and outputs {output_mean:.0f} tokens. The mechanism is the same: parallel "
        "sampling saves more the larger the prompt's share of each sequence (a short prompt or a long "
        "output leaves little to share), and beam search the longer its beams keep a common history, "
        "which depends on how peaked the model's next-token distribution is."
    )
    return text
