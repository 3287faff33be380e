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
    key: tuple[str, str, bool]
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


def json_schema_ebnf(schema: str, any_whitespace: bool) -> str:
    """The EBNF of a JSON schema, in which every string character is one JSON allows unescaped:
    no raw control character in any string, bounded or not."""
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return grammar.replace(_LEAKY_STRING_CHAR, _JSON_STRING_CHAR)


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

    def compile(self, kind: str, spec: str, any_whitespace: bool) -> xgr.CompiledGrammar:
        """Compile ``spec`` of ``kind`` (a :data:`~pagedkv.engine.structured.params.KINDS`
        name); raises ValueError with xgrammar's reason when the spec is not valid."""
        try:
            return self._compile(kind, spec, any_whitespace)
        except (RuntimeError, ValueError) as err:  # xgrammar raises RuntimeError for bad specs
            raise ValueError(error_text(err)) from None

    def _compile(self, kind: str, spec: str, any_whitespace: bool) -> xgr.CompiledGrammar:
        compiler = self._compiler
        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else '{"type": "object"}'
            return compiler.compile_grammar(json_schema_ebnf(schema, any_whitespace))
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_as_ebnf(json.loads(spec)))
        if kind == "grammar":
            return compiler.compile_lark(spec) if is_lark(spec) else compiler.compile_grammar(spec)
        raise ValueError(f"unknown structured output kind {kind!r}")
