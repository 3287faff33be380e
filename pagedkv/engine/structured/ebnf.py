"""Reading the EBNF text xgrammar prints for a grammar (``str(xgrammar.Grammar)``).

xgrammar normalises every grammar it builds -- from a JSON schema, a regex, EBNF or Lark -- to
one printed form: one rule a line, ``name ::= body`` and an optional lookahead ``(= ...)``;
bodies made of string literals, character classes (escapes spelled ``\\xNN``, ``\\uNNNN``,
``\\UNNNNNNNN``), rule names, groups, ``|`` and the repetitions ``* + ? {m, n}`` (``n`` = -1:
unbounded). This module reads that form, for these uses:

- :func:`is_satisfiable`: whether any finite text at all is a sentence of the grammar (a
  productive-rule fixed point): a regex like ``[^\\s\\S]`` compiles, but no output can ever
  complete it, and a request with it would only fail once generating;
- :func:`rename_rules` and :func:`substitute`: splicing one grammar's rules into another
  (the JSON grammar's whitespace replaced by the default or a client's pattern), so that
  nothing inside a string literal or a character class is ever touched;
- :func:`from_gbnf`: llama.cpp's GBNF spellings xgrammar's parser does not read;
- :func:`only_whitespace`: whether every character a grammar can write is JSON whitespace.

Anything outside the printed form raises ValueError: a caller that only wanted to check
something treats that as "cannot tell".
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<define>::=)
  | (?P<look>\([=!])
  | (?P<repeat>\{\s*-?\d+\s*(?:,\s*-?\d*\s*)?\})
  | (?P<op>[()|*+?,=])
  | (?P<call>[A-Za-z_]\w*\()
  | (?P<name>[A-Za-z_][A-Za-z0-9_-]*)
  | (?P<comment>\#[^\n]*)
  | (?P<dot>\.)
    """,
    re.VERBOSE,
)

_ESCAPES = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "0": 0, "b": 8, "a": 7, "e": 27}
_HEX = {"x": 2, "u": 4, "U": 8}
#: Code points a sentence can hold: surrogates are not text (the UTF-8 guard forbids them).
_TEXT = ((0, 0xD7FF), (0xE000, 0x10FFFF))
_JSON_WHITESPACE = frozenset(" \t\n\r")


class Token(NamedTuple):
    kind: str
    text: str


def tokenize(text: str) -> list[Token]:
    """The printed grammar as tokens; joining their texts gives ``text`` back exactly."""
    tokens = [Token(match.lastgroup, match.group()) for match in _TOKEN.finditer(text)]
    if sum(len(token.text) for token in tokens) != len(text):  # finditer skipped something
        at = 0
        for token in tokens:
            if not text.startswith(token.text, at):
                break
            at += len(token.text)
        raise ValueError(f"unexpected {text[at : at + 20]!r} in the grammar")
    return tokens


def _code_points(body: str) -> list[int]:
    """The characters of a literal's or a class's body, escapes decoded."""
    points, at = [], 0
    while at < len(body):
        char = body[at]
        if char != "\\":
            points.append(ord(char))
            at += 1
            continue
        escape = body[at + 1]
        if escape in _HEX:
            width = _HEX[escape]
            points.append(int(body[at + 2 : at + 2 + width], 16))
            at += 2 + width
        else:
            points.append(_ESCAPES.get(escape, ord(escape)))
            at += 2
    return points


def class_ranges(token: str) -> tuple[bool, list[tuple[int, int]]]:
    """A character class ``[...]`` as (negated, inclusive code point ranges)."""
    body = token[1:-1]
    negated = body.startswith("^")
    # An unescaped "-" between two characters makes a range; an escaped one is a character.
    at, marked = 1 if negated else 0, []
    while at < len(body):
        if body[at] == "\\":
            end = at + 2 + _HEX.get(body[at + 1], 0)
        else:
            end = at + 1
        marked.append((body[at:end], body[at:end] == "-"))
        at = end
    ranges, index = [], 0
    while index < len(marked):
        first = marked[index][0]
        if index + 2 < len(marked) and marked[index + 1][1]:
            low, high = _code_points(first)[0], _code_points(marked[index + 2][0])[0]
            ranges.append((low, high))
            index += 3
        else:
            point = _code_points(first)[0]
            ranges.append((point, point))
            index += 1
    return negated, ranges


@functools.lru_cache(maxsize=4096)
def class_text_points(token: str) -> tuple[tuple[int, int], ...]:
    """The text code points a class matches, as sorted disjoint ranges (surrogates left out;
    cached: the same few classes recur in every JSON grammar)."""
    negated, ranges = class_ranges(token)
    merged: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    if negated:
        complement, start = [], 0
        for low, high in merged:
            if low > start:
                complement.append((start, low - 1))
            start = max(start, high + 1)
        if start <= 0x10FFFF:
            complement.append((start, 0x10FFFF))
        merged = complement
    return tuple(
        (max(low, t_low), min(high, t_high))
        for low, high in merged
        for t_low, t_high in _TEXT
        if max(low, t_low) <= min(high, t_high)
    )


def rules(tokens: list[Token]) -> dict[str, list[Token]]:
    """Each rule's body tokens (spaces left out), by name, in the order printed."""
    found: dict[str, list[Token]] = {}
    solid = [t for t in tokens if t.kind != "space"]
    current: list[Token] | None = None
    for index, token in enumerate(solid):
        if token.kind == "define":
            continue
        if token.kind == "name" and index + 1 < len(solid) and solid[index + 1].kind == "define":
            current = found.setdefault(token.text, [])
            continue
        if current is None:
            raise ValueError(f"{token.text!r} before the first rule")
        current.append(token)
    return found


# -- satisfiability ------------------------------------------------------------------------------
class _Parser:
    """A rule body as a tree: ("alt" | "seq", children), ("rep", child, min), ("ref", name),
    ("chars", nonempty), ("regex", pattern) or ("look",)."""

    def __init__(self, body: list[Token]) -> None:
        self.body = body
        self.at = 0
        #: The rules the body names.
        self.references: set[str] = set()

    def parse(self) -> tuple:
        tree = self.alternatives()
        while self.at < len(self.body):  # a lookahead after the body
            if self.body[self.at].kind != "look":
                raise ValueError(f"unexpected {self.body[self.at].text!r} in a rule")
            self.atom()
        return tree

    def _next_is(self, *texts: str) -> bool:
        return self.at < len(self.body) and self.body[self.at].text in texts

    def alternatives(self) -> tuple:
        options = [self.sequence()]
        while self._next_is("|"):
            self.at += 1
            options.append(self.sequence())
        return ("alt", options)

    def sequence(self) -> tuple:
        items = []
        while self.at < len(self.body) and not self._next_is("|", ")"):
            item = self.atom()
            while self.at < len(self.body) and (
                self.body[self.at].kind == "repeat" or self._next_is("*", "+", "?")
            ):
                item = ("rep", item, _repeat_min(self.body[self.at].text))
                self.at += 1
            items.append(item)
        return ("seq", items)

    def atom(self) -> tuple:
        token = self.body[self.at]
        self.at += 1
        if token.kind == "string":
            return ("chars", True)
        if token.kind == "cls":
            return ("chars", bool(class_text_points(token.text)))
        if token.kind == "name":
            self.references.add(token.text)
            return ("ref", token.text)
        if token.kind == "call":
            return self.call(token.text[:-1])
        if token.text in ("(", "(=", "(!"):
            inner = self.alternatives()
            if not self._next_is(")"):
                raise ValueError("unbalanced parentheses in the grammar")
            self.at += 1
            return ("look",) if token.kind == "look" else inner
        raise ValueError(f"unexpected {token.text!r} in a rule")

    def call(self, function: str) -> tuple:
        """``Regex("...", json_string=true)``: a string matching the regex (JSON-escaped text)."""
        if function != "Regex" or self.at >= len(self.body) or self.body[self.at].kind != "string":
            raise ValueError(f"{function}(...) in a rule")
        pattern = json.loads(self.body[self.at].text)
        while self.at < len(self.body) and not self._next_is(")"):
            self.at += 1
        self.at += 1
        return ("regex", pattern)


def _repeat_min(text: str) -> int:
    if text in ("*", "?"):
        return 0
    if text == "+":
        return 1
    return int(text.strip("{}").split(",")[0])


class _Productive:
    """The productive rules of a grammar (see :func:`is_satisfiable`)."""

    def __init__(self, trees: dict[str, tuple], regex_satisfiable: Callable[[str], bool]) -> None:
        self.trees = trees
        self.regex_satisfiable = regex_satisfiable
        self.rules: set[str] = set()
        self.regexes: dict[str, bool] = {}

    def grow(self, users: dict[str, set[str]]) -> None:
        """To the fixed point, by a worklist: a rule is tried again only when a rule it names
        has just become productive (``users[name]``: the rules that name ``name``), so the
        work is linear in the grammar's size times the few times a rule is retried."""
        pending = list(self.trees)
        while pending:
            name = pending.pop()
            if name in self.rules or not self.holds(self.trees[name]):
                continue
            self.rules.add(name)
            pending.extend(user for user in users.get(name, ()) if user not in self.rules)

    def holds(self, node: tuple) -> bool:
        kind = node[0]
        if kind in ("chars", "look"):
            return kind == "look" or node[1]
        if kind == "regex":
            if node[1] not in self.regexes:
                self.regexes[node[1]] = self.regex_satisfiable(node[1])
            return self.regexes[node[1]]
        if kind == "ref":
            if node[1] not in self.trees:
                raise ValueError(f"rule {node[1]!r} is not defined")
            return node[1] in self.rules
        if kind == "rep":
            return node[2] == 0 or self.holds(node[1])
        if kind == "seq":
            return all(self.holds(child) for child in node[1])
        return any(self.holds(child) for child in node[1])


def is_satisfiable(grammar: str, regex_satisfiable: Callable[[str], bool], root: str = "root") -> bool:
    """Whether some finite text of valid Unicode is a sentence of ``grammar`` (printed form).

    A rule is productive when some alternative of its body is: a literal always is, a class
    when it holds a character that is not a surrogate, a repetition when it may repeat zero
    times or its item is productive, a rule name when that rule is, ``Regex(p)`` when
    ``regex_satisfiable(p)``. Lookaheads are taken as satisfiable, so the answer errs on the
    side of "yes".
    """
    trees: dict[str, tuple] = {}
    users: dict[str, set[str]] = {}
    for name, body in rules(tokenize(grammar)).items():
        parser = _Parser(body)
        trees[name] = parser.parse()
        for used in parser.references:
            users.setdefault(used, set()).add(name)
    if root not in trees:
        raise ValueError(f"the grammar has no {root!r} rule")
    productive = _Productive(trees, regex_satisfiable)
    productive.grow(users)
    return root in productive.rules


# -- llama.cpp's GBNF -----------------------------------------------------------------------------
#: What llama.cpp's ``.`` matches: any character.
_ANY_CHAR = r"[\0-\U0010ffff]"


def from_gbnf(grammar: str) -> str:
    """llama.cpp's GBNF spelled as xgrammar's EBNF reads it: an empty alternative (``ws ::= |
    " "``, ``("a" | )``) becomes ``""``, and ``.`` any character. Raises ValueError on text
    this reader does not know (llama.cpp's token references ``<[id]>``, among others)."""
    tokens = tokenize(grammar)
    solid = [i for i, t in enumerate(tokens) if t.kind not in ("space", "comment")]
    empty_after: set[int] = set()  # token indices after which an empty alternative is missing
    for position, index in enumerate(solid):
        token = tokens[index]
        following = tokens[solid[position + 1]] if position + 1 < len(solid) else None
        opens = token.kind in ("define", "look") or token.text in ("(", "|")
        after = tokens[solid[position + 2]] if position + 2 < len(solid) else None
        closes = (
            following is None
            or following.text in ("|", ")")
            or (following.kind == "name" and after is not None and after.kind == "define")
        )
        if opens and closes:
            empty_after.add(index)
    out = []
    for index, token in enumerate(tokens):
        out.append(_ANY_CHAR if token.kind == "dot" else token.text)
        if index in empty_after:
            out.append(' ""')
    return "".join(out)


# -- splicing ------------------------------------------------------------------------------------
def rename_rules(grammar: str, rename: Callable[[str], str]) -> str:
    """``grammar`` with every rule name (definitions and references) passed through ``rename``."""
    return "".join(rename(t.text) if t.kind == "name" else t.text for t in tokenize(grammar))


#: A string literal or a character class (kept as they are), or a rule name and what follows it.
_LITERAL_OR_REFERENCE = re.compile(
    r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|(?<![\w-])([A-Za-z_][\w-]*)(\{[^}]*\}|\s*::=)?'
)


def substitute(grammar: str, names: Iterable[str], repeat: str, replacement: str) -> str:
    """``grammar`` with every reference to one of ``names`` repeated by exactly ``repeat``
    (e.g. ``{0, 7}``) replaced by ``replacement``, in one pass that leaves string literals and
    character classes as they are; raises ValueError if another use of them is left."""
    names, wanted = set(names), _spaced(repeat)

    def replace(match: re.Match) -> str:
        name, after = match.group(1), match.group(2)
        if name is None or name not in names or (after is not None and "::=" in after):
            return match.group()
        if after is None or _spaced(after) != wanted:
            raise ValueError(f"rule {name!r} is used other than as {name}{repeat}")
        return replacement

    return _LITERAL_OR_REFERENCE.sub(replace, grammar)


def _spaced(repeat: str) -> str:
    return "".join(repeat.split())


def only_whitespace(grammar: str) -> bool:
    """Whether every character ``grammar`` can write is JSON whitespace (space, tab, newline,
    carriage return)."""
    for token in tokenize(grammar):
        if token.kind == "string":
            if not all(chr(p) in _JSON_WHITESPACE for p in _code_points(token.text[1:-1])):
                return False
        elif token.kind == "cls":
            for low, high in class_text_points(token.text):
                if not all(chr(p) in _JSON_WHITESPACE for p in range(low, min(high, low + 4) + 1)):
                    return False
                if high - low > 4:
                    return False
    return True
