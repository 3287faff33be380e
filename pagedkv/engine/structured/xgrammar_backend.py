"""The grammar library behind structured output: xgrammar, as in vLLM and SGLang.

xgrammar compiles a spec once per tokenizer into a grammar with a precomputed token-mask cache
(most steps then fill a row of the mask from that cache); a matcher walks one sequence through
it, and forks and rolls back natively. Its import costs seconds (it brings transformers), so this
module is imported only when the first structured request compiles, on a compile thread.

Only this module imports xgrammar: the rest of the package sees :class:`CompiledGrammar` and
:class:`~pagedkv.engine.structured.matcher.GrammarMatcher`.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import xgrammar as xgr
from tokenizers import Tokenizer as BackendTokenizer
from transformers import PreTrainedTokenizerFast

from pagedkv.engine.structured import ebnf
from pagedkv.engine.structured.matcher import GrammarMatcher
from pagedkv.engine.structured.utf8_guard import Utf8Guard

#: xgrammar's C++ errors start with a timestamp and a source location: not for users.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

#: The character class xgrammar gives the characters of a length-bounded JSON string
#: (``maxLength`` / ``minLength``): it lets raw control characters through, which no JSON
#: parser accepts (RFC 8259 section 7). Its unbounded strings exclude them, as
#: :data:`_JSON_STRING_CHAR` does.
_LEAKY_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def error_text(err: BaseException) -> str:
    """An xgrammar error as one line a client can read."""
    text = _CPP_PREFIX.sub("", str(err).strip())
    return " ".join(text.split())


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """One spec compiled for one tokenizer: shared, read-only, by every request that asks for it."""

    #: The :meth:`StructuredOutputsParams.key` it was compiled from.
    key: tuple[str, str, str]
    #: xgrammar's compiled grammar.
    grammar: xgr.CompiledGrammar = field(repr=False)
    #: Seconds the compile took.
    compile_seconds: float
    #: The vocabulary's surrogate rule, given to every matcher (see :mod:`.utf8_guard`).
    guard: Utf8Guard | None = field(default=None, repr=False)
    #: Name of the thread that compiled it (never the engine's: see the compiler).
    compiled_on: str = field(default_factory=lambda: threading.current_thread().name)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar, for one sequence."""
        return GrammarMatcher(xgr.GrammarMatcher(self.grammar), guard=self.guard)


#: How JSON may space its tokens (the compiler picks one per request; see ``Whitespace``).
ANY, NONE, BOUNDED = "any", "none", "bounded"
#: The default JSON whitespace between any two tokens: nothing or one space (outlines' default,
#: ``[ ]?``, which vLLM's outlines backend served). Compact JSON: no run a small model can loop
#: on, and no pretty-printing that spends a tight ``max_tokens`` on indents (llama.cpp's rule,
#: one newline and an indent of up to 20, is a ``whitespace_pattern`` away).
BOUNDED_WHITESPACE = r'"" | " "'
#: xgrammar's bound on a whitespace run, used as a marker: its JSON grammar then names every
#: run ``whitespace_K{0, 7}`` of rules ``whitespace_K ::= (([ \n\r\t]))``, which are replaced.
_MARK = 7
_WHITESPACE_RULE = r"(([ \n\r\t]))"
#: A printed rule: its name and its body (xgrammar prints one a line).
_RULE = re.compile(r"^([\w-]+) ::= (.*)$", re.MULTILINE)


class WhitespacePatternError(ValueError):
    """A JSON whitespace pattern that cannot be used (it is not a regex, or matches more than
    whitespace)."""


def json_schema_ebnf(schema: str, whitespace: str = BOUNDED, pattern: str | None = None) -> str:
    """The EBNF of a JSON schema, spaced as ``whitespace`` says (:data:`ANY`, :data:`NONE`,
    :data:`BOUNDED`) or, given, as the regex ``pattern`` matches between any two tokens; every
    string character is one JSON allows unescaped (no raw control character, bounded or not)."""
    if whitespace == NONE:
        grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    elif whitespace == ANY and pattern is None:
        grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True))
    else:
        marked = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=_MARK))
        grammar = _respaced(marked, BOUNDED_WHITESPACE if pattern is None else None, pattern)
    return grammar.replace(_LEAKY_STRING_CHAR, _JSON_STRING_CHAR)


def _respaced(grammar: str, body: str | None, pattern: str | None) -> str:
    """``grammar`` (marked) with every whitespace run replaced by a new rule: ``body``, or the
    rules of the regex ``pattern``."""
    defined = dict(_RULE.findall(grammar))
    runs = [name for name, body in defined.items() if body == _WHITESPACE_RULE]
    name = "json_ws"
    while any(n == name or n.startswith(name + "_") for n in defined):
        name += "_"
    if pattern is None:
        rules = f"{name} ::= ({body})\n"
    else:
        rules = _pattern_rules(pattern, name)
    return ebnf.substitute(grammar, runs, f"{{0, {_MARK}}}", name) + rules


def _pattern_rules(pattern: str, name: str) -> str:
    """The regex ``pattern`` as rules whose root is ``name`` (the others ``name_<rule>``)."""
    try:
        grammar = str(xgr.Grammar.from_regex(pattern))
    except (RuntimeError, ValueError) as err:
        raise WhitespacePatternError(f"is not a regex xgrammar reads: {error_text(err)}") from None
    if not ebnf.only_whitespace(grammar):
        raise WhitespacePatternError(
            "matches more than whitespace: JSON allows only spaces, tabs, newlines and carriage returns "
            "between its tokens"
        )
    return ebnf.rename_rules(grammar, lambda rule: name if rule == "root" else f"{name}_{rule}")


def check_json_schema(schema: str) -> None:
    """Raise ValueError with xgrammar's reason when ``schema`` is not a JSON schema it reads."""
    try:
        xgr.Grammar.from_json_schema(schema)
    except (RuntimeError, ValueError) as err:
        raise ValueError(error_text(err)) from None


def choice_as_ebnf(choices: Iterable[str]) -> str:
    """``root ::= "a" | "b"``: a JSON string literal is an EBNF string literal (the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """vLLM's rule: a grammar is EBNF when some rule is defined with ``::=``, else Lark."""
    return "::=" not in grammar


class XgrammarBackend:
    """Compiles specs for one tokenizer and vocabulary; safe to call from several threads."""

    def __init__(self, tokenizer: BackendTokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        """``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's;
        ``stop_token_ids`` end a sequence, and the grammar allows them only once complete."""
        # transformers' wrapper is what xgrammar reads a vocabulary from (byte-level, byte
        # fallback or raw, and the prefix space); a copy, as the wrapper may set padding.
        wrapper = PreTrainedTokenizerFast(tokenizer_object=BackendTokenizer.from_str(tokenizer.to_str()))
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            wrapper, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        # pagedkv keeps its own cache (bounded, keyed by the request's spec): none in xgrammar.
        # One thread per compile: the compiler's pool sets how many compiles run at once, so
        # compiles never take more cores than the deployer gave them.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.utf8_guard = Utf8Guard(self.tokenizer_info.decoded_vocab, vocab_size)

    def compile(
        self, kind: str, spec: str, whitespace: str = BOUNDED, whitespace_pattern: str | None = None
    ) -> xgr.CompiledGrammar:
        """Compile ``spec`` of ``kind`` (a :data:`~pagedkv.engine.structured.params.KINDS`
        name), JSON spaced as :func:`json_schema_ebnf` says. Raises ValueError with xgrammar's
        reason when the spec is not valid, or when no text at all completes it (a regex like
        ``[^\\s\\S]``: a request would fail while generating); WhitespacePatternError when
        ``whitespace_pattern`` is at fault."""
        try:
            grammar = self._grammar(kind, spec, whitespace, whitespace_pattern)
        except WhitespacePatternError:
            raise
        except (RuntimeError, ValueError) as err:  # xgrammar raises RuntimeError for bad specs
            raise ValueError(error_text(err)) from None
        if kind != "choice" and not _satisfiable(grammar):  # a choice is its non-empty strings
            raise ValueError("nothing matches it: no output can ever complete it")
        return self._compiler.compile_grammar(grammar)

    def _grammar(self, kind: str, spec: str, whitespace: str, whitespace_pattern: str | None) -> xgr.Grammar:
        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else '{"type": "object"}'
            return xgr.Grammar.from_ebnf(json_schema_ebnf(schema, whitespace, whitespace_pattern))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_as_ebnf(json.loads(spec)))
        if kind == "grammar":
            return xgr.Grammar.from_lark(spec) if is_lark(spec) else xgr.Grammar.from_ebnf(_gbnf(spec))
        raise ValueError(f"unknown structured output kind {kind!r}")


def _gbnf(grammar: str) -> str:
    """llama.cpp's GBNF as xgrammar reads it (:func:`ebnf.from_gbnf`); text that reader does not
    know goes to xgrammar as written, whose parser then says what is wrong."""
    try:
        return ebnf.from_gbnf(grammar)
    except ValueError:
        return grammar


def _satisfiable(grammar: xgr.Grammar) -> bool:
    """:func:`ebnf.is_satisfiable` on xgrammar's printed grammar; True when it cannot tell."""
    try:
        return ebnf.is_satisfiable(str(grammar), lambda regex: _satisfiable(xgr.Grammar.from_regex(regex)))
    except (RuntimeError, ValueError, RecursionError):  # xgrammar's RuntimeError for the regex
        return True
