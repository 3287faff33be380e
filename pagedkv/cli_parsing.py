"""argparse building blocks: value types (sizes, counts, fractions, vLLM's JSON options), each
refusing a bad value with a message that names what was expected; registering a subcommand; and
a dataclass read from the parsed options, its own refusals turned into usage errors."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.memory.kv_bytes import parse_bytes
from pagedkv.memory.pool_sizing import AUTO


def byte_size(text: str) -> int:
    """argparse type for '80GB', '256MiB', ...: keeps parse_bytes' message on bad input."""
    try:
        value = parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory size must be positive, got {text!r}")
    return value


def layer_windows(text: str) -> tuple[int | None, ...]:
    """argparse type for ``--layer-windows``: "4096,full" -> (4096, None)."""
    windows: list[int | None] = []
    for part in text.split(","):
        word = part.strip().lower()
        if word == "full":
            windows.append(None)
        elif word.isdigit() and int(word) > 0:
            windows.append(int(word))
        else:
            raise argparse.ArgumentTypeError(
                f"a layer's window is a positive number of tokens or 'full', got {part.strip()!r}"
            )
    return tuple(windows)


def kv_memory_size(text: str) -> int | str:
    """argparse type for ``--kv-cache-memory``: "auto" or a positive size."""
    return AUTO if text.strip().lower() == AUTO else byte_size(text)


def _number(text: str, kind: type[int] | type[float], accept: Callable[[float], bool], wanted: str) -> Any:
    """``text`` as a ``kind`` that ``accept`` takes, or argparse's error saying ``wanted``."""
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
    if not accept(value):  # a comparison with nan is false: refused too
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v > 0, "positive")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "positive")


def offload_size(text: str) -> int:
    """argparse type for ``--kv-offloading-size``: a bare number is GiB (vLLM's unit), else a
    size with its unit ('512MiB')."""
    try:
        return byte_size(f"{float(text)}GiB")
    except ValueError:
        return byte_size(text)


def share_fraction(text: str) -> float:
    """argparse type for a share of the engine: a number in (0, 1]."""
    return _number(text, float, lambda v: 0.0 < v <= 1.0, "above 0 and at most 1")


def unit_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def speculative_config(text: str) -> SpeculativeConfig:
    """argparse type for ``--speculative-config``: a JSON object in vLLM's shape."""
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_command(
    subparsers: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int], doc: str
) -> argparse.ArgumentParser:
    """Register the subcommand ``name``: its help is the first paragraph of ``doc`` (the
    registering function's docstring), its description the rest; ``args.run(args)`` (also
    ``args.func``) carries it out and ``args.parser`` reports usage errors."""
    summary, _, details = inspect.cleandoc(doc).partition("\n\n")
    summary = " ".join(summary.split())
    parser = subparsers.add_parser(name, help=summary, description=" ".join(details.split()) or summary)
    parser.set_defaults(run=run, func=run, parser=parser)
    return parser


@contextlib.contextmanager
def usage_errors(args: argparse.Namespace) -> Iterator[None]:
    """A ValueError while a command builds its configuration is a usage error (exit status 2)."""
    try:
        yield
    except ValueError as err:
        args.parser.error(str(err))


C = TypeVar("C")


def config_from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """The dataclass ``cls`` from the parsed options named like its fields, and ``overrides``;
    an invalid value is a usage error (exit status 2) with the class's own message."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = {name: value for name, value in vars(args).items() if name in names}
    with usage_errors(args):
        return cls(**(given | overrides))
