"""Structured output on the HTTP API: the request fields that constrain the output, and their grammar.

A request may constrain its output in one of these ways (two at once is a 400 naming the second):

- OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object), or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}``
  (a JSON value the schema validates; ``strict`` or not, the schema is enforced);
  ``{"type": "text"}`` asks for nothing;
- vLLM's ``structured_outputs``: ``{"json": ...}``, ``{"regex": ...}``, ``{"choice": [...]}``,
  ``{"grammar": ...}`` or ``{"json_object": true}``, with ``disable_any_whitespace``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``;
- llama.cpp's ``json_schema`` (a schema) and ``grammar`` (GBNF), SGLang's ``regex`` and
  ``ebnf``: the same constraints under the names those servers read (:data:`GUIDED_FIELDS`);
- tools with ``tool_choice`` ``"required"`` or a named function (:mod:`pagedkv.server.tools`).

How JSON is spaced: the engine's default (at most one space), ``disable_any_whitespace``, or a
regex the whitespace between tokens matches -- vLLM's ``guided_whitespace_pattern`` or
``structured_outputs.whitespace_pattern`` -- which applies to whichever JSON constraint the
request has (a 400 naming it when the request has none).

:class:`Constraint` carries the engine's :class:`StructuredOutputsParams` and the request field it
came from, so every refusal -- its shape here, its size and cost in the engine's compiler --
names the field the client wrote. :func:`compile_constraint` compiles it on the engine's grammar
compiler and awaits the result off the event loop, before anything is queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import typing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from pagedkv.engine import InvalidRequestError, StructuredOutputsParams
from pagedkv.engine.structured.config import WHITESPACE_PATTERN_FIELD, field_name
from pagedkv.engine.structured.params import JSON_KINDS, KINDS
from pagedkv.server.errors import APIError

if TYPE_CHECKING:
    from pagedkv.engine.structured.manager import StructuredOutputManager
    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar


def _wire_model(name: str, params: type, doc: str) -> type[BaseModel]:
    """The request body's shape of the dataclass ``params``, so the two cannot drift apart: its
    fields, types and defaults, unknown fields refused. A field whose name a pydantic model
    already uses (``json``) is held under that name plus ``_``, read and written by its own
    name (the alias)."""
    hints = typing.get_type_hints(params)
    fields: dict[str, Any] = {
        (f"{field.name}_" if hasattr(BaseModel, field.name) else field.name): (
            hints[field.name],
            Field(default=field.default, alias=field.name),
        )
        for field in dataclasses.fields(params)
    }
    return create_model(name, __config__=ConfigDict(extra="forbid"), __doc__=doc, **fields)


StructuredOutputsRequest = _wire_model(
    "StructuredOutputsRequest",
    StructuredOutputsParams,
    """vLLM's ``structured_outputs`` field: exactly one constraint. Its fields are those of
:class:`~pagedkv.engine.StructuredOutputsParams` (``json`` by its alias), passed on whole.""",
)


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint and the request field it came from."""

    params: StructuredOutputsParams
    #: The field errors name, e.g. ``response_format.json_schema.schema`` or ``guided_regex``.
    field: str
    #: The field that gave ``params.whitespace_pattern``, if one did.
    whitespace_field: str | None = None

    def refusal(self, err: InvalidRequestError) -> APIError:
        """The engine's refusal (which names ``structured_outputs.<kind>`` or
        ``structured_outputs.whitespace_pattern``) as a 400 naming the request's field instead."""
        engine_field, field = field_name(self.params), self.field
        if err.param == WHITESPACE_PATTERN_FIELD and self.whitespace_field is not None:
            engine_field, field = WHITESPACE_PATTERN_FIELD, self.whitespace_field
        message = str(err)
        if message.startswith(engine_field):
            message = field + message[len(engine_field) :]
        return APIError.bad_request(message, param=field)


def _make(field: str, **kwargs: Any) -> Constraint:
    """``StructuredOutputsParams(**kwargs)``; its refusal becomes a 400 in the request's words."""
    try:
        return Constraint(StructuredOutputsParams(**kwargs), field)
    except ValueError as err:
        if field == "structured_outputs" or field.startswith("structured_outputs."):
            message = str(err).replace("StructuredOutputsParams", "structured_outputs")
            if message.startswith(WHITESPACE_PATTERN_FIELD):
                field = WHITESPACE_PATTERN_FIELD
        else:
            message = re.sub(r"StructuredOutputsParams\.\w+", field, str(err))
        raise APIError.bad_request(message, param=field) from None


def _from_structured_outputs(value: StructuredOutputsRequest) -> Constraint:
    fields = value.model_dump(by_alias=True)  # StructuredOutputsParams' fields, by their names
    given = [kind for kind in KINDS if fields[kind] is not None and fields[kind] is not False]
    field = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return _make(field, **fields)


def _from_response_format(value: ResponseFormat) -> Constraint | None:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return _make("response_format", json_object=True)
    if value.json_schema is None or value.json_schema.schema_ is None:
        raise APIError.bad_request(
            'response_format of type "json_schema" needs json_schema.schema',
            param="response_format.json_schema",
        )
    return _make("response_format.json_schema.schema", json=value.json_schema.schema_)


#: vLLM's older fields, llama.cpp's and SGLang's: each the StructuredOutputsParams field it sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json",  # llama.cpp: a schema object
    "grammar": "grammar",  # llama.cpp: GBNF
    "regex": "regex",  # SGLang
    "ebnf": "grammar",  # SGLang
}


def request_constraint(
    structured_outputs: StructuredOutputsRequest | None,
    response_format: ResponseFormat | None,
    guided: dict[str, Any],
    tools: Constraint | None = None,
    whitespace_pattern: str | None = None,
) -> Constraint | None:
    """The one constraint a request asks for (None: none); ``guided`` maps each of
    :data:`GUIDED_FIELDS` to its value, ``tools`` is what ``tool_choice`` asks for,
    ``whitespace_pattern`` is ``guided_whitespace_pattern``. Two at once: a 400."""
    found: list[Constraint] = []
    if tools is not None:
        found.append(tools)
    if structured_outputs is not None:
        found.append(_from_structured_outputs(structured_outputs))
    if response_format is not None and (made := _from_response_format(response_format)) is not None:
        found.append(made)
    for name, kind in GUIDED_FIELDS.items():
        if guided.get(name) is not None:
            found.append(_make(name, **{kind: guided[name]}))
    if len(found) > 1:
        first, second = found[0].field.split(".")[0], found[1].field.split(".")[0]
        raise APIError.bad_request(
            f"{second} cannot be combined with {first}: a request constrains its output one way",
            param=second,
        )
    constraint = found[0] if found else None
    if whitespace_pattern is not None:
        return _spaced(constraint, whitespace_pattern, "guided_whitespace_pattern")
    if constraint is not None and constraint.params.whitespace_pattern is not None:
        return replace(constraint, whitespace_field="structured_outputs.whitespace_pattern")
    return constraint


def _spaced(constraint: Constraint | None, pattern: str, field: str) -> Constraint:
    """``constraint`` with its JSON spaced by ``pattern``; a 400 naming ``field`` when it has no
    JSON to space, or already says how."""
    if constraint is None or constraint.params.kind not in JSON_KINDS:
        raise APIError.bad_request(
            f"{field} says how JSON is spaced, and the request constrains its output to no JSON "
            "(it needs a json schema or json_object constraint)",
            param=field,
        )
    try:
        params = replace(constraint.params, whitespace_pattern=pattern)
    except ValueError as err:
        message = re.sub(r"StructuredOutputsParams\.whitespace_pattern", field, str(err))
        raise APIError.bad_request(message, param=field) from None
    return Constraint(params, constraint.field, whitespace_field=field)


async def compile_constraint(
    manager: StructuredOutputManager, constraint: Constraint | None
) -> CompiledGrammar | None:
    """The constraint's grammar, compiled on the engine's compile threads while the event loop
    goes on; an invalid or too costly spec is a 400 naming the request's field."""
    if constraint is None:
        return None
    try:
        future = manager.compile_async(constraint.params)
        return await asyncio.wrap_future(future)
    except InvalidRequestError as err:
        raise constraint.refusal(err) from None
