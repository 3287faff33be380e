"""Tool calls in a model's own words: one parser per format, chosen by ``--tool-call-parser``.

With ``tool_choice="auto"`` the model decides whether to call a tool, in the format its chat
template taught it; a parser finds the calls in the finished text (vLLM's parsers, by vLLM's
names):

- ``hermes`` (:mod:`.hermes`): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
  number, after optional text -- Hermes, Qwen 2.5 / 3, and the built-in model's template;
- ``llama3_json`` (:mod:`.llama3_json`): the whole answer is ``{"name": ..., "parameters": {...}}``
  (``arguments`` also read), optionally after ``<|python_tag|>``, several joined by ``;``.

Text that does not parse as the format's calls is the answer's content, as it was written (a
model that half-writes a call is not an error). While streaming, :meth:`ToolParser.content_end`
says how much of the text so far is surely content: what could still begin a call is held back.
"""

from __future__ import annotations

from pagedkv.server.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser
from pagedkv.server.tool_parsers.hermes import HermesToolParser
from pagedkv.server.tool_parsers.llama3_json import Llama3JsonToolParser

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedOutput", "ToolParser", "tool_parser"]

#: ``--tool-call-parser`` names (vLLM's) and their parsers.
TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def tool_parser(name: str) -> ToolParser:
    """The parser named ``name``; ValueError naming the known ones otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
