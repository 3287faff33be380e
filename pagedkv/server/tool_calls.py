"""A chat answer's tool calls: the text a choice generated, as content and ``tool_calls``.

One :class:`AnswerTools` per choice reads the text the way the request's tool mode
(:func:`pagedkv.server.tools.resolve_tool_choice`) says it was written:

- ``"named"``: the text is the arguments of the named function (the grammar saw to it);
  streamed as it comes, the first delta carrying the call's id and name;
- ``"required"``: the text is a JSON array ``[{"name": ..., "parameters": {...}}]``; the calls go
  out whole when the choice ends (an array cut by ``max_tokens`` keeps the calls complete
  before the cut, and its ``finish_reason: "length"``);
- ``"auto"``: the server's tool call parser (:mod:`pagedkv.server.tool_parsers`) splits the
  text; while streaming, content goes out as long as it cannot be the start of a call, and the
  calls go out whole when the choice ends.

With ``parallel_tool_calls: false`` an answer carries one call at most: ``"required"`` is
constrained to one, and under ``"auto"`` the calls after the first the parser found are dropped
(vLLM's rule: the model may write several, the answer keeps the first).

A choice that ends with calls has ``finish_reason: "tool_calls"`` (``"required"`` and
``"auto"``; a named function keeps ``"stop"``, as OpenAI and vLLM answer it). Text that is not
the calls it should be -- cut by ``max_tokens`` before a call is whole -- is returned as content,
as it was written.
"""

from __future__ import annotations

import json
import uuid

from pagedkv.server.responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from pagedkv.server.tool_parsers import ParsedCall, ParsedOutput, ToolParser


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_required(text: str) -> ParsedOutput:
    """The calls of a ``"required"`` answer: the array's items, or -- cut before its end by
    ``max_tokens`` -- the items complete before the cut; ``text`` as content if not one is."""
    items = _complete_items(text)
    if not items:
        return ParsedOutput(text)
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return ParsedOutput(text)
        arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(ParsedCall(item["name"], arguments))
    return ParsedOutput(None, calls)


def _complete_items(text: str) -> list:
    """The whole items at the start of the JSON array ``text`` (which may be cut anywhere)."""
    decoder = json.JSONDecoder()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return []
    items: list = []
    at += 1
    while True:
        at += len(text[at:]) - len(text[at:].lstrip())
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)
        at += len(text[at:]) - len(text[at:].lstrip())
        if not text.startswith(",", at):
            return items
        at += 1


class AnswerTools:
    """Reads one choice's text as its tool mode says; see the module docstring."""

    def __init__(
        self,
        mode: str,
        parser: ToolParser | None = None,
        function_name: str | None = None,
        one_call: bool = False,
    ) -> None:
        """``one_call``: ``parallel_tool_calls`` is false, and the answer keeps the first call."""
        if mode == "auto" and parser is None:
            raise ValueError('tool mode "auto" needs a tool call parser')
        if mode == "named" and function_name is None:
            raise ValueError('tool mode "named" needs the function name')
        self.mode = mode
        self.parser = parser
        self.function_name = function_name
        self.one_call = one_call
        self._text = ""
        self._sent = 0  # characters of _text that went out as content (auto) or arguments (named)
        self._call_id = tool_call_id()
        self._named_started = False  # the named call's first delta (id, name) went out

    # -- a whole answer ------------------------------------------------------------------------
    def complete(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of a finished answer."""
        if self.mode == "named":
            call = ToolCall(id=self._call_id, function=FunctionCall(name=self.function_name, arguments=text))
            return None, [call], finish_reason
        parsed = self._parse(text)
        if not parsed.calls:
            return text, [], finish_reason
        calls = [
            ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.calls
        ]
        return parsed.content, calls, _with_calls(finish_reason)

    # -- streaming -----------------------------------------------------------------------------
    def stream(
        self, delta_text: str, finish_reason: str | None
    ) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        """What one engine delta of this choice sends: (content, tool call deltas, finish reason)."""
        self._text += delta_text
        if self.mode == "named":
            return None, self._named_delta(), finish_reason
        if finish_reason is None:
            if self.mode == "required":
                return None, None, None
            return self._content_upto(self.parser.content_end(self._text)), None, None
        parsed = self._parse(self._text)
        if not parsed.calls:
            return self._content_upto(len(self._text)), None, finish_reason
        content = self._content_upto(len(parsed.content or ""))
        deltas = [
            DeltaToolCall(
                index=i,
                id=tool_call_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
            )
            for i, call in enumerate(parsed.calls)
        ]
        return content, deltas, _with_calls(finish_reason)

    def _named_delta(self) -> list[DeltaToolCall] | None:
        arguments = self._text[self._sent :]
        self._sent = len(self._text)
        if not self._named_started:
            self._named_started = True
            function = DeltaFunctionCall(name=self.function_name, arguments=arguments)
            return [DeltaToolCall(index=0, id=self._call_id, type="function", function=function)]
        return (
            [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments))] if arguments else None
        )

    def _content_upto(self, end: int) -> str | None:
        if end <= self._sent:
            return None
        piece, self._sent = self._text[self._sent : end], end
        return piece

    def _parse(self, text: str) -> ParsedOutput:
        if self.mode == "required":
            parsed = parse_required(text)
        elif self.mode == "auto":
            parsed = self.parser.parse(text)
        else:
            return ParsedOutput(text)
        if self.one_call and len(parsed.calls) > 1:
            return ParsedOutput(parsed.content, parsed.calls[:1])
        return parsed


def _with_calls(finish_reason: str | None) -> str | None:
    """A choice that stopped by itself with calls finishes with ``"tool_calls"``."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
