"""The JSON schema keywords the grammar cannot enforce, found before anything compiles.

xgrammar compiles a schema into a grammar, and some keywords it reads without enforcing: the
grammar then allows output the schema refuses (each case below is checked against xgrammar's
behaviour in the tests). A request with such a keyword is refused naming it and where it sits
(``json schema keyword 'uniqueItems' (at properties.tags) is not supported``), as vLLM's
xgrammar backend refuses the ones it knows of -- rather than served JSON its own schema fails.

:func:`unsupported_keyword` walks every subschema (``properties``, ``items``, ``$defs``,
``anyOf``, ...; never inside ``const``, ``enum``, ``default`` or ``examples``, which are
values) with an explicit stack, in time linear in the schema. Refused:

- keywords never enforced: :data:`NEVER_ENFORCED`;
- ``allOf`` with more than one entry (only one is read), and ``oneOf`` whose branches may
  overlap (read as ``anyOf``: an output matching two branches would be accepted);
- ``format`` values of the JSON Schema standard xgrammar does not implement (others are
  annotations, as the standard says: any string);
- ``multipleOf`` except an integer's by an integer; a number's, string's, array's or object's
  bound in a schema whose ``type`` does not say it is one (read only with the type);
- ``required`` naming a property ``properties`` does not define; a ``$ref`` beside validation
  keywords, or one that is not a pointer into the schema (``#`` or ``#/...``);
- ``enum`` or ``const`` values that ``type`` refuses (the values win in the grammar).
"""

from __future__ import annotations

from typing import Any

#: Keywords the grammar ignores (or misreads) whatever they say.
NEVER_ENFORCED = (
    "uniqueItems", "contains", "minContains", "maxContains", "patternProperties", "not", "if", "then",
    "else", "dependentSchemas", "dependentRequired", "dependencies", "$dynamicRef", "$recursiveRef",
)  # fmt: skip
#: The JSON Schema standard's formats (2020-12) that xgrammar enforces ...
ENFORCED_FORMATS = frozenset(
    ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
)  # fmt: skip
#: ... and those it does not (it accepts any string).
UNENFORCED_FORMATS = frozenset(("idn-email", "idn-hostname", "iri", "iri-reference", "regex"))
#: Keywords read only when ``type`` names their type.
TYPED_KEYWORDS = {
    "minimum": ("integer", "number"), "maximum": ("integer", "number"),
    "exclusiveMinimum": ("integer", "number"), "exclusiveMaximum": ("integer", "number"),
    "minLength": ("string",), "maxLength": ("string",), "pattern": ("string",), "format": ("string",),
    "minItems": ("array",), "maxItems": ("array",),
    "minProperties": ("object",), "maxProperties": ("object",),
}  # fmt: skip
#: Keywords that may stand beside ``$ref`` (annotations and definitions).
BESIDE_REF = frozenset(
    ("$ref", "$defs", "definitions", "title", "description", "default", "examples", "$comment")
)
#: Where subschemas sit: one schema, a list of them, or a name -> schema map.
ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
       "additionalItems")  # fmt: skip
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
MAPS = ("properties", "$defs", "definitions")

_JSON_TYPES = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def unsupported_keyword(schema: Any) -> str | None:
    """The refusal of the first keyword of ``schema`` the grammar cannot enforce, or None."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        # A property name is a string: its schema's string keywords are read without a type.
        implied = ("string",) if path == "propertyNames" or path.endswith(".propertyNames") else ()
        reason = _refusal(node, schema, implied)
        if reason is not None:
            keyword, why = reason
            where = f" (at {path})" if path else ""
            return f"json schema keyword {keyword!r}{where} is not supported: {why}"
        stack.extend(reversed(list(_children(node, path))))
    return None


def _children(node: dict, path: str):
    def at(*parts: object) -> str:
        return ".".join([path, *map(str, parts)] if path else map(str, parts))

    for key in ONE:
        if isinstance(node.get(key), dict):
            yield node[key], at(key)
    for key in (*MANY, "items"):
        if isinstance(node.get(key), list):
            yield from ((item, at(key, i)) for i, item in enumerate(node[key]))
    for key in MAPS:
        if isinstance(node.get(key), dict):
            yield from ((item, at(key, name)) for name, item in node[key].items())


def _types(node: dict, implied: tuple[str, ...] = ()) -> tuple[str, ...]:
    declared = node.get("type", list(implied))
    if isinstance(declared, str):
        return (declared,)
    return tuple(t for t in declared if isinstance(t, str)) if isinstance(declared, list) else ()


def _refusal(node: dict, root: Any, implied: tuple[str, ...]) -> tuple[str, str] | None:
    """(keyword, why) for the first keyword of this one schema object the grammar cannot enforce."""
    for keyword in NEVER_ENFORCED:
        if keyword in node and not (keyword == "uniqueItems" and node[keyword] is False):
            return keyword, "the grammar does not enforce it"
    types = _types(node, implied)
    for check in (_combinators, _format_and_bounds, _ref, _values):
        reason = check(node, types, root)
        if reason is not None:
            return reason
    return None


def _combinators(node: dict, types: tuple[str, ...], root: Any) -> tuple[str, str] | None:
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "allOf", "the grammar reads only one entry of it; merge them into one schema"
    branches = node.get("oneOf")
    if isinstance(branches, list) and len(branches) > 1 and not _disjoint(branches, root):
        return "oneOf", "its branches may overlap, and the grammar reads it as anyOf; use anyOf"
    required = node.get("required")
    if isinstance(required, list):
        defined = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in required if name not in defined]
        if missing:
            return "required", f"it names {missing[0]!r}, which properties does not define"
    return None


def _format_and_bounds(node: dict, types: tuple[str, ...], root: Any) -> tuple[str, str] | None:
    if node.get("format") in UNENFORCED_FORMATS:
        return "format", f"the grammar does not enforce the format {node['format']!r}"
    if "multipleOf" in node and not (types == ("integer",) and _is_integer(node["multipleOf"])):
        return "multipleOf", "the grammar enforces it only for type integer by an integer"
    for keyword, needs in TYPED_KEYWORDS.items():
        if keyword in node and not set(types) & set(needs):
            return keyword, f"the grammar reads it only when type says {' or '.join(needs)}"
    return None


def _ref(node: dict, types: tuple[str, ...], root: Any) -> tuple[str, str] | None:
    if "$ref" not in node:
        return None
    ref = node["$ref"]
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return "$ref", "only references into the schema itself (# or #/...) are read"
    beside = sorted(set(node) - BESIDE_REF)
    if beside:
        return beside[0], "the grammar does not read keywords beside $ref; wrap them in allOf with one entry"
    return None


def _values(node: dict, types: tuple[str, ...], root: Any) -> tuple[str, str] | None:
    if not types:
        return None
    values = (
        [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else []
    )
    for value in values:
        if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in types):
            keyword = "const" if "const" in node else "enum"
            return keyword, f"its value {value!r} is not of the type {' or '.join(types)}"
    return None


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _resolve(node: Any, root: Any) -> Any:
    """A local ``$ref`` (``#/a/b``) followed once; anything else as it is."""
    if (
        not isinstance(node, dict)
        or not isinstance(node.get("$ref"), str)
        or not node["$ref"].startswith("#/")
    ):
        return node
    target = root
    for part in node["$ref"][2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return node
        target = target[part]
    return target


def _disjoint(branches: list, root: Any) -> bool:
    """Whether no value can match two of ``branches``: each declares one JSON type, none shared
    (integer counts as a number), or each is an object with a property every branch requires
    whose ``const`` (or one-value ``enum``) differs from branch to branch (a tagged union)."""
    resolved = [_resolve(branch, root) for branch in branches]
    if not all(isinstance(b, dict) for b in resolved):
        return False
    kinds = [_types(b) for b in resolved]
    if all(len(k) == 1 for k in kinds):
        families = ["number" if k[0] == "integer" else k[0] for k in kinds]
        if len(set(families)) == len(families):
            return True
    return _tagged(resolved)


def _tagged(branches: list[dict]) -> bool:
    tags = [_tags(b) for b in branches]
    for name in set.intersection(*(set(t) for t in tags)):
        values = [t[name] for t in tags]
        if len({repr(v) for v in values}) == len(values):
            return True
    return False


def _tags(branch: dict) -> dict[str, Any]:
    """A branch's required properties that hold one value, and that value."""
    properties = branch.get("properties") if isinstance(branch.get("properties"), dict) else {}
    required = branch.get("required") if isinstance(branch.get("required"), list) else []
    tags = {}
    for name in required:
        spec = properties.get(name)
        if isinstance(spec, dict):
            if "const" in spec:
                tags[name] = spec["const"]
            elif isinstance(spec.get("enum"), list) and len(spec["enum"]) == 1:
                tags[name] = spec["enum"][0]
    return tags
