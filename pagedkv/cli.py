"""The ``pagedkv`` command line.

One subcommand per ``_add_<name>(subparsers)`` function, which registers its options and sets
``run`` to the function that carries it out; ``main`` only parses and dispatches. A new
subcommand is one more ``_add_`` function and one line in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from pagedkv.bench import capacity, sharing
from pagedkv.bench.commands import BENCHES, CAPACITY, SHARING
from pagedkv.bench.driver import add_bench, run_section
from pagedkv.cli_args import add_engine_options, engine_config
from pagedkv.cli_parsing import add_command, byte_size, config_from_args, layer_windows, usage_errors
from pagedkv.cli_report import DEFAULT_OUT, ReportOptions, add_report_options, show_report
from pagedkv.memory.kv_bytes import KV_CACHE_DTYPE_NAMES
from pagedkv.server.cli import add_serve_parser
from pagedkv.sim import WORKLOAD_NAMES, SimConfig, SimResult, simulate
from pagedkv.sim.html_replay import write_replay
from pagedkv.sim.report import print_report

BENCH_HELP = "benchmarks that run pagedkv and a baseline side by side"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv", description="An LLM inference engine built around a paged KV cache (PagedAttention)."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(subparsers)
    _add_simulate(subparsers)
    _add_generate(subparsers)
    add_serve_parser(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args)


# -- simulate ------------------------------------------------------------------------------------
def _add_simulation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("simulation")
    group.add_argument(
        "--workload",
        choices=WORKLOAD_NAMES,
        default="normal",
        help="request lengths: 'normal' (responses ~ Normal(500, 200)), 'sharegpt' (log-normal chat mix), "
        "'shared-prefix' (a common system prompt + unique parts) (default: %(default)s)",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="random seed; same seed, same figures (default: 0)"
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    group.add_argument("--max-seq-len", type=int, default=2048, help="context length (default: 2048)")
    group.add_argument(
        "--gpu-memory", type=byte_size, default="80GB", help="GPU memory, e.g. 80GB, 24GiB (default: 80GB)"
    )
    group.add_argument(
        "--weights-memory",
        type=byte_size,
        default="13GiB",
        help="memory taken by the weights; the rest holds the KV cache (default: 13GiB, a 7B model in fp16)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPE_NAMES,
        default="auto",
        help="KV element type: auto (the model's fp16), fp8 or int8 (one byte plus a float32 scale per "
        "token and KV head) (default: auto)",
    )
    group.add_argument(
        "--layer-windows",
        type=layer_windows,
        default=(),
        help="a windowed model: per layer, repeated over the layers, its sliding window or 'full', e.g. "
        "4096,full (Gemma 2) or 1024,1024,1024,1024,1024,full (Gemma 3); adds experiment (g), hybrid "
        "paging vs whole-context allocation",
    )
    group.add_argument(
        "--prefill-chunk",
        type=int,
        default=2048,
        help="prompt tokens one step computes, in experiment (g) (default: %(default)s)",
    )
    group.add_argument(
        "--prefix-len",
        type=int,
        default=None,
        help="system prompt tokens of the shared-prefix workload and the prefix-sharing experiment "
        "(default: 600, or half of --max-seq-len if that is less)",
    )


def _add_simulate(subparsers: argparse._SubParsersAction) -> None:
    """naive vs paged KV memory on seeded workloads (tables, plots, --json, --html replay)

    Compare contiguous KV allocation (Max, Pow2, Oracle reservations) with paged allocation (the
    real BlockPool/BlockTable) on the same seeded workload: utilization per batch size, a dynamic
    trace, the block-size trade-off, prefix sharing, capacity and a worked example.
    """
    parser = add_command(subparsers, "simulate", _run_simulate, _add_simulate.__doc__)
    _add_simulation_options(parser)
    add_report_options(parser)
    parser.add_argument(
        "--html",
        type=Path,
        metavar="DIR",
        default=None,
        help="also write the dynamic trace as a replay: one self-contained HTML file in DIR that opens "
        "from disk (naive vs paged memory maps, a time slider)",
    )


def _run_simulate(args: argparse.Namespace) -> int:
    config = config_from_args(SimConfig, args)
    result = simulate(config, progress=sys.stderr.isatty())
    replay = None if args.html is None else write_replay(result, args.html)
    console = Console()
    extra = {"replay": None if replay is None else str(replay)}
    show_report(args, result, _write_plots, print_report, console, extra_json=extra)
    if replay is not None and not args.json:
        console.print(f"\nReplay written to [bold]{replay}[/] (open it in a browser)", soft_wrap=True)
    return 0


# -- demo ----------------------------------------------------------------------------------------
def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    """a guided tour: the simulator, then the live engine on the built-in model

    Run the naive-vs-paged simulator on its defaults and write its plots, then the live engine:
    a batch's KV use, block sharing, and paged vs contiguous reservation.
    """
    parser = add_command(subparsers, "demo", _run_demo, _add_demo.__doc__)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        help="folder for the report (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--no-engine", action="store_true", help="skip the live-engine part")


def _run_demo(args: argparse.Namespace) -> int:
    config = config_from_args(SimConfig, args)
    console = Console()
    console.print(
        "[bold]pagedkv demo[/]: how much KV-cache memory does paging save? The same seeded requests are "
        "placed in contiguous reservations and in the real paged block pool."
    )
    result = simulate(config, progress=sys.stderr.isatty())
    show_report(ReportOptions(args.out), result, _write_plots, print_report, console)
    if not args.no_engine:
        from pagedkv.live_demo import print_live_batch, run_live_batch

        console.print("\n[bold]Now the same idea in the live engine.[/]")
        max_model_len = 1024
        figures = run_live_batch(max_model_len=max_model_len, seed=args.seed)
        print_live_batch(figures, console, max_model_len)
        console.print("\n[bold]Sharing blocks: a common system prompt, parallel samples, beams.[/]")
        run_section(SHARING, sharing.demo_config(args.seed), console, args.out)
        console.print(
            "\n[bold]Paged vs contiguous reservation at one KV budget: how many requests run at once, "
            "and how much reserved memory holds no token.[/]"
        )
        run_section(CAPACITY, capacity.demo_config(args.seed), console, args.out)
    return 0


# -- generate ------------------------------------------------------------------------------------
def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    """generate text for prompts with the paged engine

    Generate completions for the given prompts in one continuous batch.
    """
    parser = add_command(subparsers, "generate", _run_generate, _add_generate.__doc__)
    parser.add_argument(
        "prompts",
        nargs="*",
        # the built-in model learned Python: start it inside a docstring it can finish
        default=['def read_config(path):\n    """'],
        help="prompt texts",
    )
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="each prompt is comma-separated token ids (e.g. 1,15,27), as a model without a tokenizer needs",
    )
    sampling = parser.add_argument_group(
        "sampling (unset: the model's generation_config.json, else greedy and 32 tokens)"
    )
    sampling.add_argument("--max-tokens", type=int, default=None)
    sampling.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("-n", type=int, default=1, help="samples per prompt (share the prompt's blocks)")
    add_engine_options(parser)


#: What ``pagedkv generate`` samples with where neither a flag nor the model says: greedy, short.
_GENERATE_FALLBACKS = {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": -1}


def _run_generate(args: argparse.Namespace) -> int:
    from pagedkv.engine import SamplingParams
    from pagedkv.llm import LLM
    from pagedkv.models import BUILTIN_NOTE

    console = Console()
    config = engine_config(args)
    with usage_errors(args):  # a configuration the engine refuses (a KV tier that cannot fit)
        llm = LLM(**{**config.__dict__})
    # a flag given wins; then the model's generation_config defaults; then the command's own
    given = {name: getattr(args, name) for name in _GENERATE_FALLBACKS if getattr(args, name) is not None}
    values = _GENERATE_FALLBACKS | llm.engine.default_sampling_params | given
    params = config_from_args(SamplingParams, args, **values)
    if llm.engine.is_builtin:
        console.print(f"[yellow]note:[/] {BUILTIN_NOTE}")
    console.print(f"[dim]engine: {llm.engine.describe()}[/]")
    console.print(f"[dim]{llm.engine.kv_sizing.describe()}[/]")
    prompts = args.prompts
    try:
        if args.token_ids:
            prompts = [[int(t) for t in p.split(",")] for p in prompts]
        if args.chat:
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        outputs = llm.generate(prompts, params)
    except ValueError as err:  # a rejected request (InvalidRequestError), no tokenizer, a bad id
        console.print(f"[red]error:[/] {err}")
        return 1
    for prompt, out in zip(args.prompts, outputs, strict=True):
        console.rule(repr(prompt))
        for completion in out.outputs:
            shown = repr(completion.text) if llm.tokenizer.has_text else completion.token_ids
            console.print(f"[{completion.index}] {shown}  ({completion.finish_reason})")
    stats = llm.kv_stats()
    hits, queries = stats["prefix_cache_hits_tokens"], stats["prefix_cache_queries_tokens"]
    console.print(
        f"KV: {stats['blocks_total']} blocks of {stats['block_size']} tokens "
        f"({stats['kv_cache_dtype']}, {stats['bytes_per_token']} bytes per token), "
        f"prefix-cache hits {hits}/{queries} tokens, preemptions {stats['preemptions']}"
    )
    return 0


# -- bench ---------------------------------------------------------------------------------------
def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help=BENCH_HELP, description="Every benchmark measures pagedkv and its baseline in one run."
    )
    benches = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for bench in BENCHES:
        add_bench(benches, bench)


# -- shared helpers ------------------------------------------------------------------------------
def _write_plots(result: SimResult, out: Path) -> list[Path]:
    from pagedkv.sim.plots import write_plots  # matplotlib: only paid for when plotting

    return write_plots(result, out)


if __name__ == "__main__":
    sys.exit(main())
