"""The tables of ``pagedkv bench tiers`` (:mod:`pagedkv.bench.tiers`)."""

from __future__ import annotations

from rich.console import Console

from pagedkv.bench.driver import cell, print_checks, table
from pagedkv.bench.tiers import TiersResult

_MODE_NAMES = {"off": "no tier", "host": "host", "disk": "disk", "restart": "restarted"}


def print_tiers(result: TiersResult, console: Console) -> None:
    """The prefill work and the latency per mode, then the targets."""
    cfg = result.config
    console.print(
        f"[bold]Second KV tier on multi-turn chat[/] -- {result.model}; {cfg.conversations} chats x "
        f"{cfg.turns} turns ({cfg.system_len}-token system prompt, {cfg.user_len} new user tokens and "
        f"{cfg.reply_len} greedy reply tokens a turn), turn by turn, {cfg.concurrency} requests in "
        f"flight; a pool of "
        f"{cfg.pool_blocks} blocks of {result.block_size} tokens for a working set of "
        f"{cfg.working_set_blocks}. Times on each engine's own clock."
    )
    work = table(
        "Prompt tokens: computed (of which recomputed: an earlier turn computed them already), "
        "loaded from the tier, served by the pool",
        ("mode", "prompt", "computed", "recomputed", "loaded", "pool", "hit rate"),
    )
    latency = table(
        "TTFT (ms), output tokens/s, MiB moved out of the pool and into it, preemptions by swap / all, "
        "and the last turn's hit rate",
        ("mode", "TTFT p50", "p99", "tok/s", "out", "in", "swap", "last turn"),
    )
    for mode, run in result.runs.items():
        work.add_row(
            _MODE_NAMES[mode],
            cell(run.prompt_tokens),
            cell(run.computed_tokens),
            cell(run.recomputed_tokens),
            cell(run.tier_hit_tokens),
            cell(run.pool_hit_tokens),
            cell(100 * run.hit_rate, ".1f", "%"),
        )
        throughput = run.output_tokens / run.engine_seconds if run.engine_seconds else None
        latency.add_row(
            _MODE_NAMES[mode],
            cell(1e3 * run.percentile(50), ",.0f"),
            cell(1e3 * run.percentile(99), ",.0f"),
            cell(throughput),
            cell(run.bytes_out / 2**20, ",.1f"),
            cell(run.bytes_in / 2**20, ",.1f"),
            f"{run.swapped_preemptions}/{run.preemptions}",
            cell(100 * run.last_turn_hit_rate, ".0f", "%"),
        )
    console.print(work)
    console.print(latency)
    if not result.exact:
        same = "identical" if result.same_replies else "not identical"
        console.print(
            f"  greedy replies {same} in every mode ({result.dtype}: a near-tie may round apart, "
            "not a target; --dtype float32 checks exactness)"
        )
    print_checks(console, result.checks())
