"""The ``llama3_json`` format: the answer is JSON calls, ``{"name": ..., "parameters": {...}}``.

As vLLM's ``Llama3JsonToolParser`` reads it: an answer that starts (after whitespace, and an
optional ``<|python_tag|>``) with ``{`` is one call or several joined by ``;``; ``arguments`` is
read where ``parameters`` is absent. Anything else is content, and so is an answer whose JSON
is not calls through to its end.
"""

from __future__ import annotations

import json

from pagedkv.server.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser, call_from_object

BOT = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _body(text: str) -> str | None:
    """The text after leading whitespace and ``<|python_tag|>``, if it starts a JSON object."""
    body = text.lstrip()
    if body.startswith(BOT):
        body = body[len(BOT) :].lstrip()
    return body if body.startswith("{") else None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        body = _body(text)
        if body is None:
            return ParsedOutput(text)
        calls: list[ParsedCall] = []
        at = 0
        try:
            while True:
                value, at = _DECODER.raw_decode(body, at)
                calls.append(call_from_object(value, ("parameters", "arguments")))
                rest = body[at:].lstrip()
                if not rest:
                    return ParsedOutput(None, calls)
                if not rest.startswith(";"):
                    return ParsedOutput(text)
                at = len(body) - len(rest[1:].lstrip())
        except ValueError:  # not JSON, or not a call
            return ParsedOutput(text)

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith(("{", BOT)) or BOT.startswith(body):
            return 0  # a call may be starting: hold everything
        return len(text)
