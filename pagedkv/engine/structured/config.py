"""The deployer's settings for structured output, and the limits checked before any compile.

A grammar's compile time grows with the spec (a schema's size and nesting, the length of a
choice list, bounded repetitions in a regex) times the vocabulary: a request could otherwise ask
for minutes of CPU with a few kilobytes. Two limits are checked synchronously, in time linear in
the spec, before a compile starts (:func:`check_spec`): a schema's nesting and the spec's length.
The third, ``max_compile_seconds``, bounds what no static check foresees; it is enforced by the
compiler (:mod:`pagedkv.engine.structured.compiler`). Every refusal names the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.config.checks import positive_int
from pagedkv.engine.sampling_params import unpaired_surrogate_at
from pagedkv.engine.structured.params import StructuredOutputsParams
from pagedkv.engine.validation import InvalidRequestError


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide settings for structured output (vLLM's ``StructuredOutputsConfig``)."""

    #: Longest spec accepted, in characters: the schema or choices as compact JSON, the regex
    #: or the grammar.
    max_spec_chars: int = 65536
    #: Deepest nesting of a JSON schema's objects and arrays (as JSON text: a property of a
    #: property of the root object is at depth 5).
    max_schema_depth: int = 64
    #: A compile still running after this long is refused, and its spec with it from then on.
    max_compile_seconds: float = 10.0
    #: Compiled grammars kept, least recently used first out.
    cache_size: int = 256
    #: Threads that compile grammars (off the engine thread).
    compile_threads: int = 1
    #: ``disable_any_whitespace`` for every request, whatever the request says (vLLM's setting).
    disable_any_whitespace: bool = False
    #: JSON may hold any run of whitespace between its tokens (xgrammar's and vLLM's default).
    #: Off, a request that says nothing of whitespace gets at most one space between two tokens
    #: (outlines' default): no run that eats ``max_tokens`` (small models fall into them), and
    #: no indents that spend it.
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        for name in ("max_spec_chars", "max_schema_depth", "cache_size", "compile_threads"):
            positive_int(f"StructuredOutputsConfig.{name}", getattr(self, name))
        seconds = self.max_compile_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(
                f"StructuredOutputsConfig.max_compile_seconds must be a positive number, got {seconds!r}"
            )


def field_name(params: StructuredOutputsParams) -> str:
    """The request field an error about ``params`` names, as vLLM's API spells it."""
    return f"structured_outputs.{params.kind}"


#: The field an error about ``StructuredOutputsParams.whitespace_pattern`` names.
WHITESPACE_PATTERN_FIELD = "structured_outputs.whitespace_pattern"


def schema_depth(value: Any) -> int:
    """Nesting depth of JSON containers: 0 for a scalar, 1 for a flat object or list."""
    depth, level = 0, [value]
    while level:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            break
        depth += 1
        level = [item for c in containers for item in (c.values() if isinstance(c, dict) else c)]
    return depth


def check_spec(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
    """Refuse a spec over the deployment's nesting or size limit, or one that is not valid
    Unicode (:class:`InvalidRequestError` naming the field). The depth is measured first and
    without recursion, so no spec is ever deep enough to exhaust the stack in what follows."""
    field = field_name(params)
    if params.json is not None:
        depth = schema_depth(params.json)
        if depth > config.max_schema_depth:
            raise InvalidRequestError(
                f"{field} nests {depth} levels deep, over the limit max_schema_depth = "
                f"{config.max_schema_depth}",
                param=field,
            )
    spec = params.spec
    if len(spec) > config.max_spec_chars:
        raise InvalidRequestError(
            f"{field} is {len(spec)} characters long, over the limit max_spec_chars = "
            f"{config.max_spec_chars}",
            param=field,
        )
    if unpaired_surrogate_at(spec) is not None:
        raise InvalidRequestError(
            f"{field} is not valid Unicode: it holds an unpaired surrogate", param=field
        )
    pattern = params.whitespace_pattern
    if pattern is not None and (len(pattern) > config.max_spec_chars or unpaired_surrogate_at(pattern)):
        raise InvalidRequestError(
            f"{WHITESPACE_PATTERN_FIELD} is over max_spec_chars = {config.max_spec_chars} characters or "
            "holds an unpaired surrogate",
            param=WHITESPACE_PATTERN_FIELD,
        )
