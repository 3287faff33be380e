"""``/openapi.json`` as the server really answers, so clients and fuzzers can trust it.

FastAPI documents a 422 for every route with a body; this server answers 400 in OpenAI's error
shape instead (see ``app._validation_error``). So the 422 entries and their schemas are dropped,
and each route lists the statuses it can send with :class:`ErrorResponse` bodies. The generation
routes answer JSON, or server-sent events with ``stream: true``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedkv.server.responses import ErrorResponse

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])

#: What each error status means here; a route's ``responses`` picks the ones it can send.
ERROR_MEANINGS = {
    400: "Invalid request: malformed JSON, a bad or unsupported field, a prompt too long for the "
    "context, or over a request limit; `param` names the field.",
    401: "Missing, wrong or ambiguous API key (only when the server has one).",
    413: "The body is over --max-body-size.",
    500: "The engine failed on this request (a bug); the message carries a request id to find in the "
    "server log. Other requests are not affected.",
    503: "The waiting queue is full (--max-waiting-requests), or the engine stopped; retry later.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that can answer ``statuses``."""
    return {status: {"model": ErrorResponse, "description": ERROR_MEANINGS[status]} for status in statuses}


def event_stream_or(model: type) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or an SSE stream of its chunks (``stream: true``)."""
    return {
        200: {
            "model": model,
            "description": "The response, or with `stream: true` server-sent events ending in "
            "`data: [DONE]`.",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    }


def generation_route(app: FastAPI, path: str, model: type) -> Callable[[Endpoint], Endpoint]:
    """``@app.post`` for a generation route: answers ``model`` as JSON or streams its chunks,
    and can fail with any error a request to the engine can meet."""
    responses = {**event_stream_or(model), **error_responses(400, 401, 413, 500, 503)}
    return app.post(path, response_model=None, responses=responses)


def install_openapi(app: FastAPI) -> None:
    """Replace ``app.openapi`` with one that drops FastAPI's 422 (the server sends 400)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
