"""Compile each request's constraint off the engine thread, once per spec, within the deployer's limits.

:meth:`GrammarCompiler.compile_async` checks a spec synchronously against the size and nesting
limits (:func:`~pagedkv.engine.structured.config.check_spec`, linear in the spec's length:
it raises :class:`InvalidRequestError` at once) and returns a future. The compile itself runs on the
compiler's own threads: xgrammar releases the GIL while it compiles, so the engine thread and
the server's event loop keep running. The future ends in one of three ways:

- the :class:`CompiledGrammar`, kept in an LRU cache of ``cache_size`` entries by
  :meth:`StructuredOutputsParams.key`: the same spec later gets the same object at once, and
  requests that ask for a spec already compiling share that compile;
- :class:`InvalidRequestError` naming the field, when the library refuses the spec (a schema,
  regex or grammar that is not valid, or one no output can complete), or when a schema uses a
  keyword the grammar cannot enforce (:mod:`.schema_support`, checked here, once per spec);
- :class:`InvalidRequestError` naming the field, when the compile runs past
  ``max_compile_seconds``: the future fails at that moment, not when the compile ends. A native
  compile cannot be interrupted, so it runs on to its end on its thread and its result is
  dropped; the spec is remembered as refused (refusals are kept like compiled grammars), so
  asking again costs nothing.

The caller awaits the future before the request reaches the engine (the server with
``asyncio.wrap_future``, the offline API with :meth:`GrammarCompiler.compile`): an invalid or
too costly spec is refused before any KV block or engine state exists, and the engine only ever
sees requests whose grammar is ready, so its scheduler has no "waiting for a grammar" state.

The first compile also builds the backend (imports xgrammar, reads the vocabulary): seconds,
on a compile thread, not counted against ``max_compile_seconds``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.engine.structured.config import (
    WHITESPACE_PATTERN_FIELD,
    StructuredOutputsConfig,
    check_spec,
    field_name,
)
from pagedkv.engine.structured.params import StructuredOutputsParams
from pagedkv.engine.structured.schema_support import unsupported_keyword
from pagedkv.engine.validation import InvalidRequestError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer

    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar, XgrammarBackend

Key = tuple[str, str, str]


@dataclass(eq=False)
class _Job:
    params: StructuredOutputsParams
    key: Key
    future: Future
    #: Set (under the compiler's lock) by whichever of the compile and its timer ends it first.
    settled: bool = False


def xgrammar_backend_factory(
    tokenizer: BackendTokenizer, vocab_size: int, stop_token_ids: Iterable[int]
) -> Callable[[], XgrammarBackend]:
    """What :class:`GrammarCompiler` calls, on a compile thread, to build its backend."""
    stop = list(stop_token_ids)

    def build() -> XgrammarBackend:
        # Deferred: importing xgrammar takes seconds, paid only once structured output is used.
        from pagedkv.engine.structured.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, stop)

    return build


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` into shared :class:`CompiledGrammar` objects."""

    def __init__(
        self, backend_factory: Callable[[], XgrammarBackend], config: StructuredOutputsConfig | None = None
    ) -> None:
        self.config = config or StructuredOutputsConfig()
        self._backend_factory = backend_factory
        self._backend: XgrammarBackend | None = None
        self._pool = ThreadPoolExecutor(self.config.compile_threads, thread_name_prefix="pagedkv-grammar")
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._compiled: OrderedDict[Key, CompiledGrammar] = OrderedDict()
        self._refused: OrderedDict[Key, InvalidRequestError] = OrderedDict()
        self._pending: dict[Key, _Job] = {}
        self._closed = False

    # -- public API -------------------------------------------------------------------------
    def compile_async(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """Check ``params`` against the limits (raising :class:`InvalidRequestError` now) and
        return the future of its compiled grammar; see the module docstring."""
        check_spec(params, self.config)
        key = params.key()
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            if key in self._compiled:
                self._compiled.move_to_end(key)
                future.set_result(self._compiled[key])
                return future
            if key in self._refused:
                self._refused.move_to_end(key)
                future.set_exception(self._refused[key])
                return future
            if key in self._pending:
                return self._pending[key].future
            job = self._pending[key] = _Job(params, key, future)
        self._pool.submit(self._run, job)
        return future

    def check_schema_async(self, schema: dict) -> Future[None]:
        """The future of a check that ``schema`` is a JSON schema the library reads, for a
        schema that is only read, never enforced (a tool's parameters under tool choice "auto"):
        the limits apply, the unsupported keywords do not. Its refusal names
        ``structured_outputs.json``, as a compile's does."""
        try:
            params = StructuredOutputsParams(json=schema)
        except ValueError as err:
            raise InvalidRequestError(str(err), param="structured_outputs.json") from None
        check_spec(params, self.config)
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
        return self._pool.submit(self._check_schema, params)

    def _check_schema(self, params: StructuredOutputsParams) -> None:
        from pagedkv.engine.structured.xgrammar_backend import check_json_schema

        try:
            check_json_schema(params.spec)
        except ValueError as err:
            field = field_name(params)
            raise InvalidRequestError(f"{field} is not valid: {err}", param=field) from None

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """:meth:`compile_async` and wait: for a caller that may block (the offline API)."""
        return self.compile_async(params).result()

    def close(self) -> None:
        """Stop compiling: compiles not yet started fail; the threads end after the running ones."""
        with self._lock:
            self._closed = True
            pending = list(self._pending.values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for job in pending:
            self._finish(
                job, error=RuntimeError("the grammar compiler was shut down before this compile ended")
            )

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers: on a compile thread ---------------------------------------------------------
    def _backend_instance(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def _run(self, job: _Job) -> None:
        try:
            backend = self._backend_instance()
        except Exception as err:  # the library is missing or cannot read this vocabulary
            self._finish(job, error=err)
            return
        limit = self.config.max_compile_seconds
        timer = threading.Timer(limit, lambda: self._finish(job, error=self._too_costly(job), refuse=True))
        timer.daemon = True
        params = job.params
        whitespace, pattern = self._whitespace(params)
        started = time.perf_counter()
        timer.start()
        try:
            if params.json is not None and (reason := unsupported_keyword(params.json)) is not None:
                field = field_name(params)
                self._finish(job, error=InvalidRequestError(f"{field}: {reason}", param=field), refuse=True)
                return
            grammar = backend.compile(params.kind, params.spec, whitespace, pattern)
        except ValueError as err:
            from pagedkv.engine.structured.xgrammar_backend import WhitespacePatternError

            field = (
                WHITESPACE_PATTERN_FIELD if isinstance(err, WhitespacePatternError) else field_name(params)
            )
            self._finish(
                job, error=InvalidRequestError(f"{field} is not valid: {err}", param=field), refuse=True
            )
            return
        except Exception as err:
            self._finish(job, error=err)
            return
        finally:
            timer.cancel()
        seconds = time.perf_counter() - started
        if seconds >= limit:  # the timer may not have run yet: the verdict is the same
            self._finish(job, error=self._too_costly(job), refuse=True)
            return
        from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar

        self._finish(job, result=CompiledGrammar(job.key, grammar, seconds, guard=backend.utf8_guard))

    def _whitespace(self, params: StructuredOutputsParams) -> tuple[str, str | None]:
        """How ``params``' JSON is spaced -- ``"none"`` (the deployer's or the request's
        ``disable_any_whitespace``), the request's pattern, else ``"any"`` or ``"bounded"`` as
        the deployer's ``any_whitespace`` says -- and the pattern, if any."""
        if params.disable_any_whitespace or self.config.disable_any_whitespace:
            return "none", None
        if params.whitespace_pattern is not None:
            return "any", params.whitespace_pattern
        return ("any" if self.config.any_whitespace else "bounded"), None

    def _too_costly(self, job: _Job) -> InvalidRequestError:
        field = field_name(job.params)
        return InvalidRequestError(
            f"{field} is too costly to compile: still compiling after max_compile_seconds = "
            f"{self.config.max_compile_seconds:g} s",
            param=field,
        )

    def _finish(
        self,
        job: _Job,
        result: CompiledGrammar | None = None,
        error: BaseException | None = None,
        refuse: bool = False,
    ) -> None:
        """End ``job`` once (the compile and its timer race): cache the grammar or the refusal,
        then settle the future outside the lock (its callbacks may call back in)."""
        with self._lock:
            if job.settled:
                return
            job.settled = True
            if self._pending.get(job.key) is job:
                del self._pending[job.key]
            if result is not None:
                self._remember(self._compiled, job.key, result)
            elif refuse and isinstance(error, InvalidRequestError):
                self._remember(self._refused, job.key, error)
        if result is not None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)

    def _remember(self, cache: OrderedDict, key: Key, value: object) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.config.cache_size:
            cache.popitem(last=False)
