"""Tools on ``/v1/chat/completions``: their definitions, ``tool_choice``, and the grammar that forces a call.

``tool_choice`` (OpenAI's, with vLLM's rules):

- ``"none"``: the model answers in text (the tools still reach the chat template);
- ``"auto"`` (the default when ``tools`` are given): the model decides, and the server's tool
  call parser (``--enable-auto-tool-choice --tool-call-parser NAME``) finds the calls in what
  it wrote; without them a request that asks for ``"auto"`` is refused;
- ``"required"``: the answer is constrained to a JSON array of one or more calls,
  ``[{"name": ..., "parameters": {...}}]``, each ``parameters`` valid under its tool's schema
  (vLLM's schema; ``parallel_tool_calls: false`` allows exactly one call);
- ``{"type": "function", "function": {"name": ...}}``: the answer is constrained to that
  function's arguments, a JSON value its ``parameters`` schema validates.

Either way the arguments of a forced call always parse, and the answer carries them as
``tool_calls`` (:mod:`pagedkv.server.tool_calls`). A bad tool definition is refused naming it
(``tools.2.function.parameters``), whatever the tool choice: under ``"auto"`` and ``"none"``
each ``parameters`` is checked to be a JSON schema (:func:`check_read_schemas`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from pagedkv.engine import InvalidRequestError, StructuredOutputsParams
from pagedkv.server.errors import APIError
from pagedkv.server.structured import Constraint, compile_constraint

if TYPE_CHECKING:
    from pagedkv.engine.structured.manager import StructuredOutputManager

#: OpenAI's rule for function names.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    #: A JSON schema of the arguments object; absent: any object.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

#: The arguments schema of a tool that gives none: any object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def resolve_tool_choice(
    tools: list[ChatTool] | None, tool_choice: ToolChoice | None, auto_enabled: bool
) -> str:
    """The request's mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``; a 400 naming
    the field when the combination cannot be served."""
    if not tools:
        if tool_choice in (None, "none", "auto"):
            return "none"
        raise APIError.bad_request("tool_choice needs tools to choose from", param="tool_choice")
    names = [tool.function.name for tool in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise APIError.bad_request(
                f"tools.{index}.function.name {name!r} is the name of an earlier tool",
                param=f"tools.{index}.function.name",
            )
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError.bad_request(
                f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        return "named"
    if choice == "auto" and not auto_enabled:
        raise APIError.bad_request(
            '"auto" tool choice (the default with tools) needs the server started with '
            '--enable-auto-tool-choice and --tool-call-parser; send tool_choice "none", '
            '"required" or a named function',
            param="tool_choice",
        )
    return choice


def tool_constraint(
    tools: list[ChatTool], mode: str, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None
) -> Constraint | None:
    """What ``"required"`` and a named function constrain the answer to (None otherwise)."""
    if mode == "named":
        name = tool_choice.function.name
        index = next(i for i, tool in enumerate(tools) if tool.function.name == name)
        schema = tools[index].function.parameters or ANY_OBJECT
        return _constraint(schema, f"tools.{index}.function.parameters")
    if mode != "required":
        return None
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [_call_schema(tool) for tool in tools]},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    definitions: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        for name, definition in (tool.function.parameters or {}).get("$defs", {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise APIError.bad_request(
                    f"tools.{index}.function.parameters defines $defs.{name} unlike an earlier tool",
                    param=f"tools.{index}.function.parameters",
                )
    if definitions:
        schema["$defs"] = definitions
    return _constraint(schema, "tools")


def _call_schema(tool: ChatTool) -> dict[str, Any]:
    parameters = {k: v for k, v in (tool.function.parameters or ANY_OBJECT).items() if k != "$defs"}
    return {
        "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
        "required": ["name", "parameters"],
    }


def _constraint(schema: dict[str, Any], field: str) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(json=schema), field)
    except ValueError as err:
        raise APIError.bad_request(f"{field}: {err}", param=field) from None


async def check_read_schemas(manager: StructuredOutputManager, tools: list[ChatTool]) -> None:
    """Under ``"auto"`` and ``"none"`` no grammar is built from the tools, but each
    ``parameters`` must still be a JSON schema (the model reads it, a parser may check calls
    against it): a 400 naming ``tools.<i>.function.parameters`` otherwise. Keywords a grammar
    could not enforce are no fault here: nothing enforces them."""
    for index, tool in enumerate(tools):
        if tool.function.parameters is None:
            continue
        field = f"tools.{index}.function.parameters"
        try:
            await asyncio.wrap_future(manager.check_schema_async(tool.function.parameters))
        except InvalidRequestError as err:
            message = str(err).replace("structured_outputs.json", field, 1)
            raise APIError.bad_request(message, param=field) from None


async def tool_at_fault(manager: StructuredOutputManager, tools: list[ChatTool]) -> APIError | None:
    """When the grammar library refuses the ``"required"`` schema: the refusal of the first
    tool whose own parameters it refuses (naming ``tools.<i>.function.parameters``), if any.
    Compiling them one by one costs only on this path, where the request fails anyway."""
    for index, tool in enumerate(tools):
        if tool.function.parameters is not None:
            try:
                await compile_constraint(
                    manager, _constraint(tool.function.parameters, f"tools.{index}.function.parameters")
                )
            except APIError as refused:
                return refused
    return None
