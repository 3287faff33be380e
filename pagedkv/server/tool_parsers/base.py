"""What every tool call parser shares: the parsed shapes, the parser's interface, two helpers."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A finished answer split into its text content (None when there is none) and its calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def call_from_object(value: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall:
    """A :class:`ParsedCall` from a decoded ``{"name": ..., <arguments key>: {...}}``; ValueError
    if it is not one (the arguments must be an object; absent, they are ``{}``)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        raise ValueError("a tool call is an object with a non-empty string 'name'")
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if not isinstance(arguments, dict):
        raise ValueError("a tool call's arguments are an object")
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_marker_start(text: str, marker: str) -> int:
    """Where ``marker`` starts in ``text``, or where a prefix of it ends ``text`` (it may be
    completed by what comes next), else ``len(text)``."""
    found = text.find(marker)
    if found >= 0:
        return found
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


class ToolParser(ABC):
    """Finds the tool calls in a model's answer; stateless, shared by every request."""

    #: ``--tool-call-parser`` name (vLLM's).
    name: str

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The calls in a finished answer; none (and ``text`` as the content) if it holds none."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How many leading characters of a still growing answer are content whatever follows."""
