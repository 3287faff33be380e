"""Errors in the OpenAI JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports -- a bad field, an unknown model, a full queue, a missing API
key -- goes out in this one shape, so the official clients raise their usual typed exceptions
(``openai.BadRequestError``, ``AuthenticationError``, ...) with the server's message in them.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

#: ``SamplingParams`` messages start with ``SamplingParams.<field>``: that field is the ``param``.
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


class APIError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields to send."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        return cls(HTTPStatus.BAD_REQUEST, message, param=param)

    @classmethod
    def from_value_error(cls, err: ValueError) -> APIError:
        """A 400 for a refused ``SamplingParams`` / engine request, naming the field if known."""
        param = getattr(err, "param", None)  # InvalidRequestError names it
        if param is None and (match := _SAMPLING_FIELD.search(str(err))):
            param = match.group(1)
        return cls.bad_request(str(err), param=param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class QueueFullError(APIError):
    """The waiting queue has no room for the request's prompts: come back later (503)."""

    def __init__(self, waiting: int, arriving: int, limit: int) -> None:
        brings = f"; this request brings {arriving} prompts" if arriving > 1 else ""
        super().__init__(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"the server is overloaded: {waiting} requests are waiting (limit {limit}{brings}); retry later",
            type="server_overloaded",
            code="queue_full",
        )


class EngineRequestError(Exception):
    """The engine ended one request with an error of its own (logged by the engine with its id)."""

    def __init__(self, engine_request_id: str) -> None:
        super().__init__(f"the engine failed request {engine_request_id}")
        self.engine_request_id = engine_request_id


class ClientGoneError(Exception):
    """The HTTP client disconnected before its (non-streaming) response was ready."""
