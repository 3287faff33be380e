"""Configuration fields that are also command-line flags: a benchmark declares each setting once.

A field declared with :func:`option` carries its help, its allowed values and its flag's shape;
:func:`check_options` enforces the allowed values (a configuration calls it from
``__post_init__``, so a bad value is refused however the configuration is built) and
:func:`add_options` turns the fields into argparse flags. The message is the same from the
command line and from Python: it names the field.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from dataclasses import field
from typing import Any


def option(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field that :func:`check_options` checks and :func:`add_options` offers as
    ``--the-field-name``. ``spec``: ``positive`` (every value > 0), ``choices`` (every value
    among them; a tuple: a subset, duplicates dropped), ``flag`` (another name: for a bool with a
    True default, the switch that turns it off), ``group`` (the help section, "title" or
    "title: description"; default "benchmark") and argparse's ``type`` (default: the value's),
    ``nargs`` and ``metavar``. A tuple default takes several values, a bool is a switch."""
    return field(default=default, metadata={"option": {"help": help, "group": "benchmark"} | spec})


def _options(cls: type) -> Iterator[tuple[dataclasses.Field, dict]]:
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def check_options(config: Any) -> None:
    """Raise ValueError, naming the field, for the first value its option does not allow."""
    for f, spec in _options(type(config)):
        value, choices = getattr(config, f.name), spec.get("choices")
        if value is None:  # an option whose None means "none" or "the default"
            continue
        many = isinstance(value, tuple)
        values = value if many else (value,)
        integer = "float" not in str(f.type)
        if spec.get("positive") and not (values and all(_positive(v, integer) for v in values)):
            kind = "integer" if integer else "number"
            what = f"a non-empty list of positive {kind}s" if many else f"a positive {kind}"
            raise ValueError(f"{f.name} must be {what}, got {value!r}")
        if choices and not (values and all(v in choices for v in values)):
            what = "a non-empty subset" if many else "one"
            raise ValueError(f"{f.name} must be {what} of {choices}, got {value!r}")


def require_positive(config: Any, *names: str) -> None:
    """Raise ValueError for the first of ``names`` whose value is not a positive integer."""
    for name in names:
        if not _positive(getattr(config, name), integer=True):
            raise ValueError(f"{name} must be a positive integer, got {getattr(config, name)!r}")


def _positive(value: Any, integer: bool) -> bool:
    kinds = int if integer else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool) and value > 0


def _value_type(f: dataclasses.Field) -> type | None:
    """What argparse converts a flag's text to: the default's type (a tuple's: its elements'), or
    for a None default the annotation's first type (``int | None``: int)."""
    if f.default is None:
        return {"int": int, "float": float}.get(str(f.type).split(" |")[0])
    return type(f.default[0] if isinstance(f.default, tuple) else f.default)


def add_options(parser: argparse.ArgumentParser, cls: type, only: set[str] | None = None) -> None:
    """A flag per :func:`option` field of ``cls`` (those named in ``only``, if given), in
    argument groups named by the options."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f, spec in _options(cls):
        if only is not None and f.name not in only:
            continue
        if spec["group"] not in groups:  # "title: description"
            title, _, description = spec["group"].partition(": ")
            groups[spec["group"]] = parser.add_argument_group(title, description or None)
        group = groups[spec["group"]]
        flag = spec.get("flag") or "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            action = "store_false" if f.default else "store_true"
            group.add_argument(flag, dest=f.name, action=action, help=spec["help"])
            continue
        many = isinstance(f.default, tuple)
        shown = " ".join(map(str, f.default)) if many else f.default
        group.add_argument(
            flag,
            dest=f.name,
            default=list(f.default) if many else f.default,
            type=spec.get("type") or _value_type(f),
            choices=spec.get("choices"),
            nargs=spec.get("nargs") or ("+" if many else None),
            metavar=spec.get("metavar"),
            help=" ".join(filter(None, (spec["help"], None if f.default is None else f"(default: {shown})"))),
        )
