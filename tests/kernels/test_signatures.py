"""The Python signature table against the C header: every entry point Python calls is declared in
``kernels.h`` (as the compiler expands it) with the same result and argument types, and the
decode stack's op record has the header's fields in the header's order, its enums the header's values."""

from __future__ import annotations

import re
import subprocess

import pytest

from pagedkv import cbuild
from pagedkv.kernels import library
from pagedkv.kernels.signatures import (
    ADDRESS,
    F32,
    I64,
    INT,
    SIGNATURES,
    DecodeBuffer,
    DecodeCode,
    DecodeOp,
)

HEADER = library.CSRC / "kernels.h"
C_TYPES = {"int64_t": I64, "float": F32, "int": INT, "void": None}


def _expanded_header() -> str:
    """The header as the compiler sees it, every prototype macro expanded."""
    command = [cbuild.compiler(), "-E", "-P", "-x", "c", str(HEADER)]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _without_bodies(text: str) -> str:
    """``text`` with every ``{...}`` block removed (function bodies, struct members)."""
    out, depth = [], 0
    for char in text:
        depth += char == "{"
        if depth == 0:
            out.append(char)
        depth -= char == "}"
    return "".join(out)


def _ctype(declaration: str) -> type | None:
    """The ctype of a C declaration (a parameter, or a result type): any pointer is an address."""
    if "*" in declaration:
        return ADDRESS
    words = [w for w in declaration.split() if w not in ("const", "static", "inline", "extern")]
    return C_TYPES[words[0]]


def _prototypes() -> dict[str, tuple[type | None, tuple[type, ...]]]:
    """``name -> (result, arguments)`` of every entry point of the table declared in the header."""
    found = {}
    pattern = re.compile(r"([A-Za-z_][\w\s*]*?)\b(\w+)\s*\(([^()]*)\)\s*;")
    for result, name, params in pattern.findall(_without_bodies(_expanded_header())):
        if name in SIGNATURES:
            params = [p.strip() for p in params.split(",")]
            found[name] = (_ctype(result), () if params == ["void"] else tuple(map(_ctype, params)))
    return found


PROTOTYPES = _prototypes()


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_each_entry_point_matches_its_prototype(name):
    assert name in PROTOTYPES, f"{name} is not declared in kernels.h"
    signature = SIGNATURES[name]
    assert PROTOTYPES[name] == (signature.result, signature.arguments)


def _header_fields(struct: str) -> list[tuple[str, type]]:
    """The fields of ``typedef struct {...} <struct>;`` in the header, in order."""
    body = re.search(r"typedef struct \{([^}]*)\} " + struct + ";", _expanded_header()).group(1)
    fields = []
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        if "*" in declaration:  # "const void *a, *b": every declarator a pointer
            base = declaration[: declaration.index("*")]
            names = [d.strip().lstrip("*") for d in declaration[len(base) :].split(",")]
            fields += [(name, ADDRESS) for name in names]
        else:  # "float a, b"
            base, rest = declaration.split(None, 1)
            fields += [(name.strip(), C_TYPES[base]) for name in rest.split(",")]
    return fields


def test_the_decode_stack_record_matches_the_header():
    assert list(DecodeOp._fields_) == _header_fields("DecodeOp")


@pytest.mark.parametrize("enum", [DecodeCode, DecodeBuffer])
def test_the_decode_stack_enums_match_the_header(enum):
    """Every opcode and fixed buffer index has the header's value (its place in the list), and
    the header none more."""
    body = re.search(r"typedef enum \{([^}]*)\} " + enum.__name__ + ";", _expanded_header()).group(1)
    names = [item.strip() for item in body.split(",") if item.strip()]
    assert all(name.isidentifier() for name in names), "the enums' values are their places"
    assert {name: value for value, name in enumerate(names)} == {
        f"DECODE_{member.name}": member.value for member in enum
    }
