"""``pagedkv serve`` and ``pagedkv bench serve``: their options and what they run.

``pagedkv/cli.py`` wires them in with :func:`add_serve_parser` and :func:`add_bench_serve_parser`;
each sets ``func`` (and ``run``, the name the main CLI dispatches on) to a function taking the
parsed arguments and returning an exit status. Heavy imports (FastAPI, uvicorn, torch) happen
only when a command runs, so ``pagedkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from pagedkv.cli_args import add_engine_options, build_engine, byte_size, positive_int

#: Read when ``--api-key`` is not given, so the key need not appear in the process list.
API_KEY_ENV = "PAGEDKV_API_KEY"


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be > 0 (or inf), got {text!r}")
    return value


# -- serve ------------------------------------------------------------------------------------------
def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve a model over the OpenAI API: POST /v1/completions and /v1/chat/completions "
        "(stream: true gives server-sent events), GET /v1/models, /health and Prometheus /metrics. "
        "Every HTTP client shares one engine step loop (continuous batching).",
    )
    add_engine_options(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    server.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    server.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every /v1 route (default: ${API_KEY_ENV}, else none)",
    )
    server.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the model folder's name)"
    )
    server.add_argument(
        "--max-body-size",
        type=byte_size,
        default="1MiB",
        help="larger request bodies get 413 (default: 1MiB)",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="a request whose prompts would make more than this many wait gets 503 (default: %(default)s)",
    )
    server.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=256,
        help="most prompts in one completions request (default: %(default)s)",
    )
    server.add_argument("--log-level", default="info", help="uvicorn log level (default: %(default)s)")
    parser.set_defaults(func=run_serve, run=run_serve, parser=parser)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedkv.server.app import create_app

    if args.api_key is not None and not args.api_key.strip():
        args.parser.error("--api-key must not be empty")
    if args.max_waiting_requests < 0:
        args.parser.error(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    engine = build_engine(args)
    app = create_app(
        engine,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_size,
        max_waiting=args.max_waiting_requests,
        max_prompts_per_request=args.max_prompts_per_request,
    )
    name = app.state.context.model_name
    auth = "API key required" if args.api_key else "no API key"
    print(
        f"serving {name!r} at http://{args.host}:{args.port}/v1 ({auth}); metrics at /metrics",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


# -- bench serve ------------------------------------------------------------------------------------
def add_bench_serve_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = bench_subparsers.add_parser(
        "serve",
        help="serving benchmark: a seeded workload at a Poisson rate against an OpenAI server",
        description="Send --num-prompts streaming completions, arriving at --request-rate per second "
        "(Poisson; inf = all at once), to --base-url, or to a server started in this process when no "
        "URL is given. Reports request and token throughput, TTFT and inter-token latency percentiles, "
        "and the server's peak KV-cache usage.",
    )
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: start one)"
    )
    target.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"default: ${API_KEY_ENV}")
    target.add_argument(
        "--served-model-name", default=None, help="model name to request (default: the server's first)"
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-prompts", type=positive_int, default=100, help="requests (default: 100)")
    workload.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests per second, or inf (default: inf)"
    )
    workload.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="most requests in flight (default: no cap)",
    )
    workload.add_argument(
        "--input-len", type=positive_int, default=64, help="prompt length in words (default: 64)"
    )
    workload.add_argument(
        "--output-len", type=positive_int, default=32, help="tokens to generate per request (default: 32)"
    )
    workload.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths vary uniformly within +-ratio of --input-len/--output-len (default: 0)",
    )
    workload.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    add_engine_options(parser)
    parser.set_defaults(func=run_bench_serve, run=run_bench_serve, parser=parser)
    return parser


def run_bench_serve(args: argparse.Namespace) -> int:
    import httpx

    from pagedkv.server.bench import BenchConfig, print_report, run_benchmark

    try:
        config = BenchConfig(
            num_prompts=args.num_prompts,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            seed=args.seed,
            model=args.served_model_name,
            api_key=args.api_key,
        )
    except ValueError as err:
        args.parser.error(str(err))
    if args.base_url is not None:
        try:
            result = run_benchmark(args.base_url, config)
        except httpx.HTTPError as err:
            print(f"error: the server at {args.base_url} failed: {err}", file=sys.stderr)
            return 1
    else:
        from pagedkv.server.app import create_app
        from pagedkv.server.runner import ServerThread

        app = create_app(build_engine(args), api_key=args.api_key, max_waiting=None)
        with ServerThread(app) as server:
            result = run_benchmark(server.base_url, config)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_report(result)
    return 0 if result.failed == 0 else 1
