"""The checks every part of the engine's settings makes of its options: each refusal is a
``ValueError`` that names the option, so a user reads which flag or keyword to change."""

from __future__ import annotations

import json
import numbers
from typing import Any


def positive_int(name: str, value: object) -> int:
    """``value`` as an int, refused unless it is a whole number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def optional_positive_int(name: str, value: object) -> int | None:
    """None stays None (the option is unset); anything else must be a positive integer."""
    return None if value is None else positive_int(name, value)


def unit_fraction(name: str, value: object) -> float:
    """``value`` as a float in [0, 1], refused otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def json_object(name: str, text: str) -> dict[str, Any]:
    """The JSON object ``text`` holds, refused when it is not valid JSON or not an object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def one_of(name: str, value: object, choices: tuple[object, ...]) -> None:
    """Refuse a ``value`` that is none of ``choices``, naming them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
