"""Reasoning parsers: a thinking model's ``<think>...</think>`` apart from its answer.

With ``--reasoning-parser`` (vLLM's names: ``qwen3``, ``deepseek_r1``) a chat answer's thinking
goes to ``message.reasoning_content`` (``delta.reasoning_content`` when streaming) and
``content`` keeps the rest; tool calls, when in play, are read from the content only. One parser
per choice reads the choice's text in the pieces the engine produces; a whole answer is the
same reading of one piece, so a streamed answer's pieces always join to the whole one's.

The reading, for both parsers:

- the answer starts in its thinking when the prompt opened it (the template ended the prompt
  inside ``<think>``) or when the answer itself opens with ``<think>`` (whitespace before it
  allowed; the tag and that whitespace are dropped). Elsewhere ``<think>`` is plain text;
- in its thinking, everything up to ``</think>`` is reasoning, everything after is content;
  an answer that never closes its thinking (cut by ``max_tokens``) is all reasoning, as vLLM
  reads it when thinking is on;
- a tag split across pieces is held back until it is known to be (or not to be) a tag, and
  what is held when the answer ends is released as what it would have been.

The parsers differ only in where an answer starts. ``qwen3`` (vLLM's): an answer that does not
open with ``<think>``, after a prompt that did not open it, has no reasoning -- with Qwen3's
``enable_thinking: false`` the template closes an empty thinking block in the prompt, so the
answer is all content. ``deepseek_r1`` (vLLM's): DeepSeek-R1's template may put ``<think>`` in
the prompt, so an answer starts in its thinking whatever the prompt shows.
"""

from __future__ import annotations

from typing import ClassVar

#: The tags both parsers read.
THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def _held_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and is shorter than it)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningParser:
    """Reads one choice's answer; see the module docstring. :meth:`feed` every piece in order,
    the last one with ``final=True``."""

    #: The name ``--reasoning-parser`` takes.
    name: ClassVar[str]

    def __init__(self, prompt_text: str) -> None:
        self._thinking_first = self.prompt_opens_thinking(prompt_text)
        self._state = _START
        self._held = ""

    @classmethod
    def prompt_opens_thinking(cls, prompt_text: str) -> bool:
        """Whether an answer to ``prompt_text`` starts in its thinking without opening it."""
        raise NotImplementedError

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` that the answer's next piece ``text`` adds; ``final``: the
        answer ends with it, nothing is held back."""
        text, self._held = self._held + text, ""
        reasoning = ""
        if self._state == _START:
            opened = text.lstrip()
            if opened.startswith(THINK_START):
                text, self._state = opened[len(THINK_START) :], _REASONING
            elif THINK_START.startswith(opened) and not final:
                self._held = text  # the tag may still be coming
                return "", ""
            else:
                self._state = _REASONING if self._thinking_first else _CONTENT
        if self._state == _REASONING:
            at = text.find(THINK_END)
            if at < 0:
                keep = 0 if final else _held_suffix(text, THINK_END)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text, self._state = text[:at], text[at + len(THINK_END) :], _CONTENT
        return reasoning, text

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer as ``(reasoning_content, content)``, each None when empty (vLLM's)."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    @classmethod
    def prompt_opens_thinking(cls, prompt_text: str) -> bool:
        """The prompt's last thinking tag opens a block (``<think>`` after any ``</think>``)."""
        return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    @classmethod
    def prompt_opens_thinking(cls, prompt_text: str) -> bool:
        return True


#: ``--reasoning-parser``'s names.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser named ``name``; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None
