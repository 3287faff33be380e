"""The ``hermes`` format: calls in ``<tool_call>`` tags, each ``{"name": ..., "arguments": {...}}``.

As vLLM's ``Hermes2ProToolParser`` reads it: text before the first ``<tool_call>`` is content;
each ``<tool_call>...</tool_call>`` (the last one may lack its closing tag, cut by the end of
the answer) holds one call. One that is not a call makes the whole answer plain content.
"""

from __future__ import annotations

import json
import re

from pagedkv.server.tool_parsers.base import ParsedOutput, ToolParser, call_from_object, held_marker_start

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        if START not in text:
            return ParsedOutput(text)
        try:
            calls = [
                call_from_object(json.loads(closed if closed else open_ended))
                for closed, open_ended in _CALL.findall(text)
            ]
        except ValueError:  # not JSON, or not a call
            return ParsedOutput(text)
        content = text[: text.index(START)]
        return ParsedOutput(content or None, calls)

    def content_end(self, text: str) -> int:
        return held_marker_start(text, START)
