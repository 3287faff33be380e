"""The FastAPI application: routes, error handlers and middleware around one engine.

``create_app`` builds everything one server needs -- the engine (or takes a ready one), its
worker thread, a metrics registry -- and nothing global, so tests and the benchmark can run
several servers in one process. uvicorn (``pagedkv serve``) or any ASGI server runs the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from pagedkv import __version__
from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.chat_protocol import ChatCompletionRequest
from pagedkv.server.dashboard import install_dashboard
from pagedkv.server.errors import APIError, ClientGoneError
from pagedkv.server.kv_events import KVEventsConfig, ZmqKVEventPublisher
from pagedkv.server.lora import ServedAdapters, install_lora_routes, parse_lora_module
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    InternalErrorMiddleware,
    NoSniffMiddleware,
)
from pagedkv.server.openapi import error_responses, generation_route, install_openapi
from pagedkv.server.prompts import PromptEncoder
from pagedkv.server.protocol import CompletionRequest
from pagedkv.server.reasoning import reasoning_parser_class
from pagedkv.server.render import install_render_routes
from pagedkv.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    HealthStatus,
    ModelCard,
    ModelList,
)
from pagedkv.server.serving import ServingContext, create_chat_completion, create_completion
from pagedkv.server.tokenize import install_tokenize_routes
from pagedkv.server.tool_parsers import tool_parser
from pagedkv.tokenizer.chat_template import compile_chat_template

#: Request bodies above this many bytes get 413 (a 1 MiB JSON body is ~250k tokens of text).
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: Requests (prompts) allowed to wait for a slot before new ones get 503.
DEFAULT_MAX_WAITING = 1024
#: Prompts one completions request may carry (each is an engine request).
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
#: The model name the built-in model is served under.
BUILTIN_MODEL_NAME = "pagedkv-builtin"

#: How many validation problems a 400 message lists (a bad union field reports one per member).
_MAX_LISTED_ERRORS = 3


class PrometheusResponse(Response):
    media_type = CONTENT_TYPE_LATEST


def default_model_name(engine: LLMEngine) -> str:
    """The Hub id a model was loaded by (as vLLM serves it), else the model folder's name, or
    :data:`BUILTIN_MODEL_NAME` for the built-in model."""
    if engine.is_builtin:
        return BUILTIN_MODEL_NAME
    return engine.model_source.repo_id or Path(engine.model_path).name


def _validation_error(err: RequestValidationError) -> APIError:
    """A 400 that says what is wrong with the body: malformed JSON, or which field and why."""
    problems = err.errors()
    for problem in problems:
        if problem.get("type") == "json_invalid":
            detail = (problem.get("ctx") or {}).get("error", "invalid JSON")
            return APIError.bad_request(f"the request body is not valid JSON: {detail}")
    if problems and problems[0]["type"] == "missing" and tuple(problems[0]["loc"]) == ("body",):
        return APIError.bad_request("the request body is empty: a JSON object is expected")
    listed = []
    for problem in problems[:_MAX_LISTED_ERRORS]:
        field = ".".join(str(part) for part in problem["loc"][1:]) or "body"
        listed.append(f"{field}: {problem['msg']}")
    more = f" (and {len(problems) - _MAX_LISTED_ERRORS} more)" if len(problems) > _MAX_LISTED_ERRORS else ""
    first = problems[0]["loc"][1:] if problems else ()
    return APIError.bad_request(
        "invalid request: " + "; ".join(listed) + more, param=".".join(map(str, first)) or None
    )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(err).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == HTTPStatus.NOT_FOUND else "invalid_request_error"
        response = APIError(err.status_code, str(err.detail), type=kind).response()
        response.headers.update(err.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(ClientGoneError)
    async def client_gone(_: Request, err: ClientGoneError) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    # Any other exception is a bug: InternalErrorMiddleware logs it once and answers 500.


def create_app(
    engine: LLMEngine | EngineConfig | None = None,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting: int | None = DEFAULT_MAX_WAITING,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    kv_events: KVEventsConfig | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    reasoning_parser: str | None = None,
    lora_modules: Sequence[str] = (),
    lora_dirs: Sequence[str] = (),
) -> FastAPI:
    """An OpenAI-compatible app over ``engine`` (a ready ``LLMEngine``, or the config to build one).

    ``api_key``: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
    ``max_waiting``: a request whose prompts would make more than this many wait gets 503 (None:
    no limit). ``max_prompts_per_request``: more prompts in one request get 400. The engine's
    ``RequestLimits`` (n, beams, tokens per request) apply to each request as a whole.
    ``kv_events``: when enabled, the block pool's changes are published over ZMQ in vLLM's
    KV-event format (:mod:`pagedkv.server.kv_events`), for ``vllm-router --policy kv_aware``.
    ``enable_auto_tool_choice`` with ``tool_call_parser`` (vLLM's ``hermes`` or ``llama3_json``):
    serve ``tool_choice="auto"``, finding the model's calls with that parser.
    ``chat_template``: Jinja source that replaces the model's chat template;
    ``trust_request_chat_template``: accept a request's own ``chat_template`` (vLLM refuses it
    otherwise). ``reasoning_parser`` (vLLM's ``qwen3`` or ``deepseek_r1``): chat answers carry the
    model's thinking in ``reasoning_content`` (:mod:`pagedkv.server.reasoning`).
    ``lora_modules`` (``name=path``, the engine started with ``enable_lora``): adapters a request's
    ``model`` may name; ``lora_dirs``: the roots ``/v1/load_lora_adapter`` may load from (the
    route exists only with them; :mod:`pagedkv.server.lora`).
    The engine's worker thread starts now and stops when the app's lifespan ends.
    """
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key must not be empty (pass None for no key)")
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if max_prompts_per_request < 1:
        raise ValueError(f"max_prompts_per_request must be positive, got {max_prompts_per_request}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser to read the model's calls")
    parser = tool_parser(tool_call_parser) if tool_call_parser is not None else None
    if reasoning_parser is not None:
        reasoning_parser_class(reasoning_parser)  # an unknown name fails now, not on a request
    if chat_template is not None:
        try:
            compile_chat_template(chat_template)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template is not a valid template: {err}") from None
    owns_engine = not isinstance(engine, LLMEngine)
    if owns_engine:
        engine = LLMEngine(engine or EngineConfig())
    model_name = served_model_name or default_model_name(engine)
    adapters = ServedAdapters(lora_dirs)
    for module in lora_modules:
        adapters.add_at_start(engine, *parse_lora_module(module))  # a bad one stops the start
    publisher = None
    if kv_events is not None and kv_events.enabled:
        publisher = ZmqKVEventPublisher(
            kv_events, engine.settings.cache.block_size, lora_roots=engine.lora_roots
        )
        engine.kv_manager.set_listener(publisher)  # before the worker thread starts
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, metrics, max_waiting)
    metrics.watch(lambda: async_engine.stats, lambda: async_engine.spec_decoding)
    ctx = ServingContext(
        engine=async_engine,
        tokenizer=engine.tokenizer,
        encoder=PromptEncoder(engine.tokenizer, engine.max_model_len),
        model_name=model_name,
        max_model_len=engine.max_model_len,
        kv_capacity_tokens=engine.validator.max_kv_tokens,
        limits=engine.validator.limits,
        max_prompts_per_request=max_prompts_per_request,
        tool_parser=parser if enable_auto_tool_choice else None,
        chat_template=chat_template,
        trust_request_chat_template=trust_request_chat_template,
        reasoning_parser=reasoning_parser,
        adapters=adapters,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await asyncio.to_thread(async_engine.shutdown)
        if publisher is not None:
            engine.kv_manager.set_listener(None)
            publisher.close()
        if owns_engine:  # an engine passed in belongs to the caller, who may reuse it
            engine.shutdown()

    # /openapi.json, not /docs or /redoc: FastAPI's pages load their scripts from a CDN, which a
    # server without internet access cannot reach and which would run on this server's origin,
    # the one whose sessionStorage holds the dashboard's API key.
    app = FastAPI(title="pagedkv", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = async_engine
    app.state.context = ctx
    app.state.metrics = metrics
    app.state.kv_event_publisher = publisher
    install_dashboard(app, async_engine, metrics, model_name, requires_key=api_key is not None)
    _install_error_handlers(app)
    install_openapi(app)

    @generation_route(app, "/v1/completions", CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, ctx)

    @generation_route(app, "/v1/chat/completions", ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, ctx)

    if lora_dirs:
        install_lora_routes(app, async_engine, adapters)
    install_render_routes(app, ctx)
    install_tokenize_routes(app, ctx)

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> ModelList:
        card = ModelCard(id=model_name, root=str(engine.model_path), max_model_len=engine.max_model_len)
        loras = [
            ModelCard(
                id=a.lora_name, root=str(a.lora_path), parent=model_name, max_model_len=engine.max_model_len
            )
            for a in adapters
        ]
        return ModelList(data=[card, *loras])

    @app.get("/health", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
    async def health() -> JSONResponse:
        problem = async_engine.health()
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": problem}, status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/metrics", response_class=PrometheusResponse)
    async def prometheus_metrics() -> PrometheusResponse:
        """Prometheus text exposition format."""
        return PrometheusResponse(metrics.render())

    # The last added runs first: the key check comes before reading any body, and every answer,
    # a refusal or a 500 too, gets nosniff.
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(NoSniffMiddleware)
    return app
