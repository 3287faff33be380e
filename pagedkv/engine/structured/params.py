"""What output a request constrains itself to: vLLM's ``StructuredOutputsParams``.

Exactly one kind is set: a JSON schema (``json``), a regular expression (``regex``), one of a
list of strings (``choice``), a grammar (``grammar``: EBNF as xgrammar and llama.cpp's GBNF
write it, or Lark) or any JSON object (``json_object=True``). The check here is the request's
own shape, field by field, with a message naming the field; what needs the deployment (size
and cost limits) or the grammar library (syntax) is checked by
:class:`~pagedkv.engine.structured.compiler.GrammarCompiler`.

This module imports nothing of pagedkv, so ``SamplingParams`` can hold one without a cycle.
"""

from __future__ import annotations

import json as json_text
from dataclasses import dataclass
from typing import Any

#: The kinds of constraint, in the order the fields are declared.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: The kinds whose output is JSON, which whitespace options space.
JSON_KINDS = ("json", "json_object")


def _is_set(value: object) -> bool:
    """A kind is set unless None or False (``json_object=False`` asks for nothing)."""
    return value is not None and value is not False


def _fail(name: str, requirement: str, value: object) -> ValueError:
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return ValueError(f"StructuredOutputsParams.{name} must be {requirement}, got {shown}")


@dataclass
class StructuredOutputsParams:
    """One request's output constraint; see the module docstring.

    Normalisation at construction: ``json`` given as text is parsed into a dict, so equal
    schemas written with different spacing share one compiled grammar (:meth:`key`), and a
    tuple of choices becomes a list.
    """

    #: A JSON schema (a dict, or its JSON text): the output is a JSON value it validates.
    json: dict[str, Any] | str | None = None
    #: The output matches this regular expression in full.
    regex: str | None = None
    #: The output is exactly one of these strings.
    choice: list[str] | None = None
    #: The output is a sentence of this grammar: EBNF / GBNF with a ``root`` rule, or Lark
    #: with a ``start`` rule (told apart as vLLM does: EBNF is the one with ``::=``).
    grammar: str | None = None
    #: The output is a JSON object, any object.
    json_object: bool | None = None
    #: No whitespace between the tokens of JSON beyond the one space after ``:`` and ``,``
    #: (``json`` and ``json_object`` only): small models tend to loop on whitespace.
    disable_any_whitespace: bool = False
    #: A regex the whitespace between any two tokens of JSON matches (``json`` and
    #: ``json_object`` only; vLLM's field): it must match nothing but spaces, tabs, newlines
    #: and carriage returns. Without it (and without ``disable_any_whitespace``) the engine's
    #: default spacing applies (see ``StructuredOutputsConfig.any_whitespace``).
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if _is_set(getattr(self, name))]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar or "
                f"json_object, got {', '.join(given) if given else 'none'}"
            )
        self.json = self._normalise_json(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _fail(name, "a non-empty string", value)
        if self.choice is not None:
            self._check_choice(self.choice)
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise _fail("json_object", "True or None", self.json_object)
        if not isinstance(self.disable_any_whitespace, bool):
            raise _fail("disable_any_whitespace", "a bool", self.disable_any_whitespace)
        if self.whitespace_pattern is not None:
            self._check_whitespace_pattern(given[0])

    def _check_whitespace_pattern(self, kind: str) -> None:
        if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
            raise _fail("whitespace_pattern", "a non-empty string", self.whitespace_pattern)
        if kind not in JSON_KINDS:
            raise ValueError(
                "StructuredOutputsParams.whitespace_pattern spaces JSON: it needs json or json_object, "
                f"not {kind}"
            )
        if self.disable_any_whitespace:
            raise ValueError(
                "StructuredOutputsParams.whitespace_pattern cannot be combined with disable_any_whitespace: "
                "one says how JSON is spaced"
            )

    @staticmethod
    def _normalise_json(schema: object) -> dict[str, Any] | None:
        if schema is None:
            return None
        if isinstance(schema, str):
            try:
                schema = json_text.loads(schema)
            except (ValueError, RecursionError) as err:
                raise _fail("json", f"a JSON schema; its text is not JSON ({err})", schema) from None
        if not isinstance(schema, dict):
            raise _fail("json", "a JSON schema object", schema)
        return schema

    @staticmethod
    def _check_choice(choice: object) -> None:
        if not isinstance(choice, (list, tuple)) or not choice:
            raise _fail("choice", "a non-empty list of strings", choice)
        if not all(isinstance(c, str) and c for c in choice):
            raise _fail("choice", "a list of non-empty strings", choice)

    @property
    def kind(self) -> str:
        """The field that is set: one of :data:`KINDS`."""
        return next(name for name in KINDS if _is_set(getattr(self, name)))

    @property
    def spec(self) -> str:
        """The constraint as one text: the schema or the choices as compact JSON (key order
        kept: it is the order the output's properties take), the regex or grammar as given,
        and ``""`` for ``json_object``."""
        kind = self.kind
        if kind in ("json", "choice"):
            return json_text.dumps(getattr(self, kind), ensure_ascii=False, separators=(",", ":"))
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def whitespace(self) -> str:
        """How the request spaces JSON: ``""`` (not JSON), ``"none"`` (``disable_any_whitespace``),
        ``"pattern:<regex>"`` (``whitespace_pattern``) or ``"default"`` (the engine's choice)."""
        if self.kind not in JSON_KINDS:
            return ""
        if self.disable_any_whitespace:
            return "none"
        if self.whitespace_pattern is not None:
            return "pattern:" + self.whitespace_pattern
        return "default"

    def key(self) -> tuple[str, str, str]:
        """What the compiled grammar depends on: equal keys share one compiled grammar."""
        return (self.kind, self.spec, self.whitespace)
