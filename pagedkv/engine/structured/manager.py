"""The engine's structured output: one grammar compiler, and a matcher for each new sequence.

The engine owns one :class:`StructuredOutputManager`. Its compiler is built on the first
constrained request (no cost to an engine that never sees one) and shared by every caller:
the offline API compiles synchronously inside ``add_request``; the server awaits
:meth:`StructuredOutputManager.compile_async` off its event loop first and hands the ready
grammar to ``add_request``, so the engine's thread never waits on a compile it did not ask
for. Either way a request reaches the scheduler with its grammar compiled: an invalid or too
costly spec is refused before any KV block exists.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.structured.compiler import GrammarCompiler, xgrammar_backend_factory
from pagedkv.engine.structured.config import StructuredOutputsConfig
from pagedkv.engine.structured.matcher import GrammarMatcher
from pagedkv.engine.structured.params import StructuredOutputsParams
from pagedkv.engine.validation import InvalidRequestError
from pagedkv.tokenizer import NoTokenizer, Tokenizer

if TYPE_CHECKING:
    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar


class StructuredOutputManager:
    """Compiles requests' constraints for one engine and starts their sequences' matchers.

    Thread-safe: the server's event loop compiles while the engine's thread admits requests.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | NoTokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        """``vocab_size`` is the width of the model's logits; ``stop_token_ids`` (the engine's
        EOS set) are the tokens a grammar allows once it is complete."""
        self.config = config or StructuredOutputsConfig()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(set(stop_token_ids))
        self._compiler: GrammarCompiler | None = None
        self._closed = False
        self._lock = threading.Lock()

    def compile_async(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The future of ``params``' compiled grammar; the limits that need no compile raise
        :class:`InvalidRequestError` at once (see :class:`GrammarCompiler`)."""
        return self._get_compiler().compile_async(params)

    def check_schema_async(self, schema: dict) -> Future[None]:
        """The future of a check that ``schema`` is a JSON schema, for one only read, never
        enforced (see :meth:`GrammarCompiler.check_schema_async`)."""
        return self._get_compiler().check_schema_async(schema)

    def matcher(
        self, params: SamplingParams, grammar: CompiledGrammar | None = None
    ) -> GrammarMatcher | None:
        """A fresh matcher for the first sequence of a request with ``params`` (None when it is
        unconstrained). ``grammar``: its constraint compiled ahead (the server's); without it the
        constraint is compiled here, blocking (a cached one returns at once)."""
        constraint = params.structured_outputs
        if constraint is None:
            if grammar is not None:
                raise ValueError("a compiled grammar was given for a request without structured_outputs")
            return None
        if grammar is None:
            grammar = self._get_compiler().compile(constraint)
        elif grammar.key != constraint.key():
            raise ValueError("the compiled grammar given is not the one of the request's structured_outputs")
        return grammar.matcher()

    def close(self) -> None:
        """Stop the compile threads (a compile still running ends on its own)."""
        with self._lock:
            self._closed = True
            compiler = self._compiler
        if compiler is not None:
            compiler.close()

    def _get_compiler(self) -> GrammarCompiler:
        if not self._tokenizer.has_text:
            raise InvalidRequestError(
                f"structured_outputs needs the tokenizer's vocabulary, and {self._tokenizer.reason}",
                param="structured_outputs",
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down: it compiles no more grammars")
            if self._compiler is None:
                factory = xgrammar_backend_factory(
                    self._tokenizer.backend, self._vocab_size, self._stop_token_ids
                )
                self._compiler = GrammarCompiler(factory, self.config)
            return self._compiler
