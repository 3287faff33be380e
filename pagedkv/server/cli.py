"""``pagedkv serve``: its options and what it runs.

``pagedkv/cli.py`` wires it in with :func:`add_serve_parser`, which sets ``func`` (and ``run``,
the name the main CLI dispatches on) to a function taking the parsed arguments and returning an
exit status. Heavy imports (FastAPI, uvicorn, torch) happen only when the command runs, so
``pagedkv --help`` stays fast. ``pagedkv bench serve`` is in :mod:`pagedkv.bench.commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from pagedkv.cli_args import add_engine_options, build_engine
from pagedkv.cli_parsing import add_command, byte_size, positive_float, positive_int

#: Read when ``--api-key`` is not given, so the key need not appear in the process list.
API_KEY_ENV = "PAGEDKV_API_KEY"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)

    Serve a model over the OpenAI API: POST /v1/completions and /v1/chat/completions (stream: true
    gives server-sent events), GET /v1/models, /health and Prometheus /metrics, and a live map of
    the KV cache's blocks in the browser at /dashboard. Every HTTP client shares one engine step
    loop (continuous batching).
    """
    parser = add_command(subparsers, "serve", run_serve, add_serve_parser.__doc__)
    add_engine_options(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    server.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    server.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every /v1 route and the dashboard's data "
        f"(default: ${API_KEY_ENV}, else none)",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the Hub id given to --model, else the model folder's name)",
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
    server.add_argument(
        "--kv-events-config",
        default=None,
        help='publish KV cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557"}\' (for vllm-router --policy kv_aware)',
    )
    _add_lora_options(parser)
    _add_tool_options(parser)
    _add_chat_options(parser)
    _add_connection_options(parser)
    replicas = parser.add_argument_group("replicas behind vllm-router")
    replicas.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        help="run this many replicas (processes) behind vllm-router, which listens on --port "
        "(default: %(default)s: one server, no router)",
    )
    replicas.add_argument(
        "--router-policy",
        default="kv_aware",
        help="vllm-router's policy: kv_aware (follows the replicas' KV cache events), cache_aware, "
        "round_robin, power_of_two, random, consistent_hash (default: %(default)s)",
    )
    replicas.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="pass one more argument to vllm-router (repeat; e.g. --router-arg=--disable-retries)",
    )
    return parser


def _add_lora_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="adapters served from the start: a request's model names one (PEFT folders; vLLM's JSON "
        'form {"name": ..., "path": ...} too)',
    )
    group.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        help="a folder POST /v1/load_lora_adapter may load adapters from (repeat; without one the load "
        "and unload routes are off)",
    )


def _add_tool_options(parser: argparse.ArgumentParser) -> None:
    # The names are tool_parsers.TOOL_PARSERS', written out so that --help stays fast.
    group = parser.add_argument_group("tool calling (tools and tool_choice on /v1/chat/completions)")
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default with tools): the model decides, --tool-call-parser '
        'finds its calls; "required" and named functions need neither option',
    )
    group.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="the format the model writes tool calls in: hermes (<tool_call> tags; Hermes, Qwen, the "
        "built-in model) or llama3_json (Llama 3's JSON calls)",
    )


def app_options(args: argparse.Namespace) -> dict:
    """``create_app``'s options from the command line, besides the engine and the KV events (one
    server's, or each replica's). A chat template that does not compile, or
    --enable-auto-tool-choice without a parser to read the calls, is refused here: before the
    engine loads."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        args.parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    from pagedkv.server.lora import parse_lora_module

    if (args.lora_modules or args.lora_dir) and not args.enable_lora:
        args.parser.error("--lora-modules and --lora-dir need --enable-lora")
    for module in args.lora_modules:
        try:
            parse_lora_module(module)
        except ValueError as err:
            args.parser.error(str(err))
    return {
        "api_key": args.api_key,
        "served_model_name": args.served_model_name,
        "max_body_bytes": args.max_body_size,
        "max_waiting": args.max_waiting_requests,
        "max_prompts_per_request": args.max_prompts_per_request,
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_parser": args.tool_call_parser,
        "chat_template": chat_template(args),
        "trust_request_chat_template": args.trust_request_chat_template,
        "reasoning_parser": args.reasoning_parser,
        "lora_modules": args.lora_modules,
        "lora_dirs": args.lora_dir,
    }


def _add_chat_options(parser: argparse.ArgumentParser) -> None:
    # The parser names are reasoning.REASONING_PARSERS', written out so that --help stays fast.
    group = parser.add_argument_group("chat (/v1/chat/completions)")
    group.add_argument(
        "--chat-template",
        default=None,
        help="the chat template to use instead of the model's: a file, or the Jinja source itself",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a request's own chat_template (refused otherwise: a template is code the server runs)",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=("qwen3", "deepseek_r1"),
        default=None,
        help="split a thinking model's <think>...</think> into the answer's reasoning_content",
    )


def read_chat_template(value: str) -> str:
    """``--chat-template``'s source, as vLLM reads it: a readable file's contents, else the value
    itself when it looks like a template (it holds ``{``); ValueError for a missing file."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as file:
            return file.read()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a readable file nor a Jinja template")


def chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's source (None without it), compiled once: one that does not compile is
    refused."""
    if args.chat_template is None:
        return None
    import jinja2

    from pagedkv.tokenizer.chat_template import compile_chat_template

    try:
        template = read_chat_template(args.chat_template)
        compile_chat_template(template)
    except (OSError, ValueError) as err:
        args.parser.error(str(err))
    except jinja2.TemplateSyntaxError as err:
        args.parser.error(f"--chat-template is not a valid template: {err}")
    return template


#: The connection options, one per ``ConnectionLimits`` field of the same name: (field, type,
#: metavar, default, help). The defaults are ConnectionLimits' (pagedkv.server.connections),
#: written out here so that --help stays fast: that module imports uvicorn.
_CONNECTION_OPTIONS = (
    (
        "timeout_keep_alive",
        positive_float,
        "SECONDS",
        5.0,
        "close a kept-alive connection idle for this many seconds (default: %(default)s)",
    ),
    (
        "timeout_request_header",
        positive_float,
        "SECONDS",
        10.0,
        "close a connection whose request line and headers are not complete this many seconds "
        "after it opened or its previous response ended; 408 if part of a request came "
        "(default: %(default)s)",
    ),
    (
        "timeout_request_body",
        positive_float,
        "SECONDS",
        30.0,
        "answer 408 and close when a request body is not complete this many seconds after its "
        "headers (default: %(default)s)",
    ),
    (
        "limit_concurrency",
        positive_int,
        "N",
        None,
        "most open connections; past it the connection that has been reading its request the "
        "longest (a slow or idle client) is closed with 503, or, when every connection is busy "
        "with a request, the new one gets 503 (default: what the open-file limit, raised to its "
        "hard limit at start, leaves after the accept backlog and 64 files, at most 16384)",
    ),
    (
        "h11_max_incomplete_event_size",
        positive_int,
        "BYTES",
        16 * 1024,
        "most bytes of a request line and headers; more gets 400 (default: %(default)s)",
    ),
)


def _add_connection_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connections (a slow or surplus client is closed, not waited for)")
    for field, kind, metavar, default, help_text in _CONNECTION_OPTIONS:
        flag = "--" + field.replace("_", "-")
        group.add_argument(flag, type=kind, metavar=metavar, default=default, help=help_text)


def connection_limits(args: argparse.Namespace):
    """The ``ConnectionLimits`` the options ask for."""
    from pagedkv.server.connections import ConnectionLimits

    try:
        return ConnectionLimits(**{field: getattr(args, field) for field, *_ in _CONNECTION_OPTIONS})
    except ValueError as err:
        args.parser.error(str(err).replace("_", "-"))


def _run_replicas(args: argparse.Namespace, options: dict) -> int:
    from pagedkv.cli_args import engine_config
    from pagedkv.server.replicas import ReplicaSet, serve_replicas

    try:
        replicas = ReplicaSet(
            engine_config(args),
            args.data_parallel_size,
            policy=args.router_policy,
            host=args.host,
            port=args.port,
            app_options=options,
            router_args=tuple(args.router_arg),
            log_level=args.log_level,
        )
    except ValueError as err:
        args.parser.error(str(err))
    return serve_replicas(replicas)


def run_serve(args: argparse.Namespace) -> int:
    from pagedkv.engine import InvalidRequestError
    from pagedkv.server.app import create_app
    from pagedkv.server.connections import raise_open_file_limit
    from pagedkv.server.kv_events import KVEventsConfig
    from pagedkv.server.runner import Server

    if args.api_key is not None and not args.api_key.strip():
        args.parser.error("--api-key must not be empty")
    if args.max_waiting_requests < 0:
        args.parser.error(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    limits = connection_limits(args)
    options = app_options(args)  # a bad template or tool option is refused before the engine loads
    raise_open_file_limit()  # before the engine opens files (replicas inherit it); the cap is sized from it
    if args.data_parallel_size > 1:
        if args.kv_events_config is not None:
            args.parser.error(
                "--kv-events-config is set per replica by --data-parallel-size; give one or the other"
            )
        return _run_replicas(args, options)
    kv_events = None
    if args.kv_events_config is not None:
        try:
            kv_events = KVEventsConfig.from_json(args.kv_events_config)
        except (ValueError, TypeError) as err:
            args.parser.error(str(err))
    engine = build_engine(args)
    try:
        app = create_app(engine, kv_events=kv_events, **options)
    except InvalidRequestError as err:  # a --lora-modules adapter this model cannot serve
        engine.shutdown()
        args.parser.error(f"--lora-modules: {err}")
    name = app.state.context.model_name
    auth = "API key required" if args.api_key else "no API key"
    print(
        f"serving {name!r} at http://{args.host}:{args.port}/v1 ({auth}); metrics at /metrics, "
        f"the live KV block map at http://{args.host}:{args.port}/dashboard",
        file=sys.stderr,
    )
    server = Server(app, limits, host=args.host, port=args.port, log_level=args.log_level)
    print(
        f"connections: at most {server.guard.max_connections} open; request headers within "
        f"{limits.timeout_request_header:g} s, bodies within {limits.timeout_request_body:g} s, "
        f"idle ones closed after {limits.timeout_keep_alive:g} s",
        file=sys.stderr,
    )
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
        server.run()
    engine.shutdown()  # a disk KV tier writes the prefix cache out, for the next start to find
    return 0 if server.started else 1
