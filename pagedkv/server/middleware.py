"""ASGI middleware that runs before any route: the API key check, the body size limit, the
``X-Content-Type-Options`` header on every response, and the answer to a bug in a handler.

All are plain ASGI (not ``BaseHTTPMiddleware``) so they never buffer or wrap streaming
responses; they only look at the request and answer early when it is refused.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.server.errors import APIError

logger = logging.getLogger("pagedkv.server")

#: Paths under these need the key: the API, the tokenizer's routes and the dashboard's data (its
#: page holds none).
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/dashboard/stream")


class HTTPMiddleware:
    """A plain ASGI middleware that acts on HTTP requests only (:meth:`http`): any other scope
    (lifespan, websocket) goes to the app as it came."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class APIKeyMiddleware(HTTPMiddleware):
    """Every ``/v1`` route and the dashboard's stream require ``Authorization: Bearer <key>``;
    others (health, metrics, the dashboard's static page) not.

    The comparison is constant-time (``hmac.compare_digest``) so response timing does not leak
    how much of a guessed key was right. A request with several ``Authorization`` headers is
    refused whatever they hold: proxies and servers disagree on which one counts.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        super().__init__(app)
        self._expected = f"Bearer {api_key}".encode()

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"].startswith(PROTECTED_PREFIXES):
            headers = [value for name, value in scope["headers"] if name.lower() == b"authorization"]
            if len(headers) > 1:
                message = f"the request has {len(headers)} Authorization headers; send exactly one"
            elif not hmac.compare_digest(headers[0] if headers else b"", self._expected):
                message = "missing or incorrect API key: send the header 'Authorization: Bearer <key>'"
            else:
                await self.app(scope, receive, send)
                return
            error = APIError(HTTPStatus.UNAUTHORIZED, message, code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class NoSniffMiddleware(HTTPMiddleware):
    """``X-Content-Type-Options: nosniff`` on every response: a browser takes each body for the
    type the server says (JSON stays JSON, never a script or a page)."""

    HEADER = (b"x-content-type-options", b"nosniff")

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == self.HEADER[0] for name, _ in headers):
                    message = {**message, "headers": [*headers, self.HEADER]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class BodySizeLimitMiddleware(HTTPMiddleware):
    """Refuse request bodies over ``max_bytes`` with 413 before any handler parses them.

    A declared ``Content-Length`` over the limit is refused unread; a chunked body is read up to
    the limit. The body read here is replayed to the app, and later ``receive`` calls (the wait
    for a client disconnect) go to the server as usual.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(int(declared), scope, receive, send)
            return
        body, more, received = bytearray(), True, 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending the body
                return
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self._refuse(received, scope, receive, send, at_least=True)
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(
        self, size: int, scope: Scope, receive: Receive, send: Send, at_least: bool = False
    ) -> None:
        error = APIError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is {'at least ' if at_least else ''}{size} bytes; "
            f"the limit is {self.max_bytes}",
            code="request_too_large",
        )
        response = error.response()
        response.headers["connection"] = "close"  # rather than read the rest of the body to keep it
        await response(scope, receive, send)


class InternalErrorMiddleware(HTTPMiddleware):
    """A bug in a handler (an exception no handler turned into an answer) is logged once, with
    its traceback and the request's id, and answered with a 500 that carries the same id and
    nothing of the exception.

    The id is the one the handler gave the request (``request.state.request_id``, e.g.
    ``chatcmpl-...``), or a fresh ``err-...`` when it failed before giving one. The exception is
    not raised further: Starlette's own handler for ``Exception`` re-raises it after answering, and
    the ASGI server would then log it a second time. A failure after the response started (a
    stream) can no longer change its status; it is logged and the response is left unfinished, so
    the client sees a broken stream rather than a complete one.
    """

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            request_id = scope.get("state", {}).get("request_id") or f"err-{uuid.uuid4().hex[:16]}"
            logger.error(
                "internal error on request %s (%s %s)",
                request_id,
                scope["method"],
                scope["path"],
                exc_info=err,
            )
            if started:
                return
            message = f"internal server error (request id {request_id}); the details are in the server log"
            error = APIError(
                HTTPStatus.INTERNAL_SERVER_ERROR, message, type="server_error", code="internal_error"
            )
            await error.response()(scope, receive, send)
