"""One worker thread owns the engine; HTTP handlers talk to it through queues.

``LLMEngine`` is not thread-safe, and it should not be: continuous batching wants every live
request in the same ``step()``. So a single worker thread drains a command queue (add, abort),
runs ``step()`` while any request is unfinished, and hands each output to the asyncio queue of
the HTTP request that asked for it (``loop.call_soon_threadsafe``). When there is nothing to do
it sleeps on a condition variable: an idle server costs no CPU.

Handlers never touch the engine. ``add`` waits for the worker to accept or refuse the request
(a too-long prompt, a full queue) so the HTTP status can still say so; ``abort`` is
fire-and-forget and returns every block of the request to the pool on the next loop. The prompts
of one HTTP request travel as one command: they are admitted (and counted against the waiting
limit) together or refused together, and one abort withdraws them all, queued ones included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagedkv.engine import InvalidRequestError, LLMEngine, LoRARequest, RequestOutput, SamplingParams
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.server.engine_calls import EngineCall
from pagedkv.server.engine_calls import settle as _settle
from pagedkv.server.errors import EngineRequestError, QueueFullError
from pagedkv.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar

logger = logging.getLogger("pagedkv.server")


class EngineObserver(Protocol):
    """Reads the engine on the worker thread, the only thread that may (the live dashboard).

    ``observe`` runs after every loop of the worker -- a step, or commands while idle -- so it
    must return quickly; ``due_in`` says how many seconds until it wants to observe even if
    nothing runs (None: only when something does), so an idle worker still wakes for it.
    """

    def observe(self, engine: LLMEngine) -> None: ...

    def due_in(self) -> float | None: ...


class Aborted(Exception):
    """Put on a stream whose request the server aborted (shutdown, an engine failure)."""


class Stream:
    """Where the worker sends one HTTP request's outputs: an asyncio queue on its event loop.

    Several engine requests (the prompts of one batch) share a stream; an item's tag is the index
    of its prompt. Items are ``(tag, RequestOutput | Exception)``.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[object, RequestOutput | BaseException]] = asyncio.Queue()

    def put(self, tag: object, item: RequestOutput | BaseException) -> None:
        """Thread-safe: called by the worker. A closed loop has no reader left to tell."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (tag, item))

    async def get(self) -> tuple[object, RequestOutput | BaseException]:
        return await self.queue.get()


@dataclass
class _Add:
    """The prompts of one HTTP request, engine request ``request_ids[i]`` for ``prompts[i]``."""

    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    stream: Stream
    accepted: asyncio.Future
    priority: int = 0
    #: The HTTP request the prompts come from: they share one fair share of the engine.
    client_request_id: str | None = None
    #: ``params.structured_outputs`` compiled (the handler awaited it): the worker never compiles.
    grammar: CompiledGrammar | None = None
    #: vLLM's ``cache_salt``: the prompts share cached blocks only with the same salt.
    cache_salt: str | None = None
    #: The LoRA adapter the prompts run with (None: the base model).
    lora_request: LoRARequest | None = None
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Live:
    """The worker's view of an accepted request: where its outputs go and its timings."""

    stream: Stream
    tag: object
    submitted: float
    last_token: float | None = None
    num_tokens: int = 0


def _finish_reason(output: RequestOutput) -> str:
    """The request's finish reason for the metrics: error, else length if any sample hit it."""
    reasons = {c.finish_reason for c in output.outputs}
    return "error" if output.error is not None else "length" if "length" in reasons else "stop"


class AsyncEngine:
    """The engine behind a worker thread. Create it inside no particular loop; it starts at once."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int | None = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._commands: deque[_Add | _Abort | EngineCall] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        #: Set (to the reason) once the worker has stopped; later requests fail at once.
        self._closed: str | None = None
        self._live: dict[str, _Live] = {}
        #: Called by the worker with the engine after every loop (see :class:`EngineObserver`).
        self.observers: list[EngineObserver] = []
        self._peak_utilization = 0.0
        self._publish_stats()
        #: The worker: it alone touches the engine (its id also serves CPU-time probes).
        self.thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self.thread.start()

    # -- called from the event loop ---------------------------------------------------------
    async def add(
        self,
        request_ids: list[str],
        prompts: list[list[int]],
        params: SamplingParams,
        stream: Stream,
        priority: int = 0,
        client_request_id: str | None = None,
        grammar: CompiledGrammar | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue every prompt or none; returns once accepted, raises ``InvalidRequestError`` /
        ``QueueFullError``. Outputs of ``prompts[i]`` arrive on ``stream`` tagged ``i``; the
        prompts count as the one client request ``client_request_id`` for fair admission.
        ``grammar``: ``params.structured_outputs`` compiled, when it is set; ``cache_salt``:
        the prompts' prefix-cache salt."""
        if len(request_ids) != len(prompts):
            raise ValueError(f"got {len(request_ids)} request ids for {len(prompts)} prompts")
        accepted = asyncio.get_running_loop().create_future()
        self._send(
            _Add(
                request_ids,
                prompts,
                params,
                stream,
                accepted,
                priority,
                client_request_id,
                grammar,
                cache_salt,
                lora_request,
            )
        )
        await accepted

    async def call(self, function: Callable[[LLMEngine], object]) -> object:
        """``function(engine)`` run on the worker between steps; its result, or its exception
        raised here (e.g. loading a LoRA adapter)."""
        done = asyncio.get_running_loop().create_future()
        self._send(EngineCall(function, done))
        return await done

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests wherever they are (queued or running); harmless if they already finished."""
        self._send(_Abort(request_ids))

    @property
    def stats(self) -> dict[str, float]:
        """The latest engine statistics (a snapshot the worker replaces after every loop)."""
        return self._stats

    @property
    def spec_decoding(self) -> SpecDecodingStats | None:
        """Every draft verified since start (a copy the worker replaces after every loop); None
        for an engine that does not speculate."""
        return self._spec_decoding

    @property
    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def health(self) -> str | None:
        """None while requests can be served, else why not (``/health``)."""
        if not self.thread.is_alive():
            return "engine stopped"
        try:
            self.engine.check_health()
        except Exception as err:  # the executor's own words: a worker rank gone, ...
            return f"engine unhealthy: {err}"
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker; requests still running end with :class:`Aborted`."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self.thread.join(timeout)

    def wake(self) -> None:
        """Have the worker ask its observers again (one has something to send, e.g. a new page)."""
        with self._wakeup:
            self._wakeup.notify()

    def _send(self, command: _Add | _Abort | EngineCall) -> None:
        with self._wakeup:
            if self._closed is not None:
                if isinstance(command, _Add | EngineCall):
                    raise Aborted(self._closed)
                return  # nothing is running any more: nothing to abort
            self._commands.append(command)
            self._wakeup.notify()

    # -- the worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        reason = "the server is shutting down"
        try:
            self._serve()
        except BaseException as err:  # a bug outside step(): do not leave anyone waiting
            logger.exception("the engine worker crashed (%r); failing %d requests", err, len(self._live))
            reason = "the engine worker crashed; the details are in the server log"
        finally:
            with self._wakeup:
                self._closed = reason
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                if isinstance(command, _Add):
                    _settle(command.accepted, Aborted(reason))
                elif isinstance(command, EngineCall):
                    _settle(command.done, Aborted(reason))
            for request_id, live in self._live.items():
                live.stream.put(live.tag, Aborted(reason))
                with contextlib.suppress(Exception):  # return its blocks if the engine still can
                    self.engine.abort(request_id)
            self._live.clear()
            with contextlib.suppress(Exception):
                self._publish_stats()

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                    due_in = self._observers_due_in()
                    if due_in is not None and due_in <= 0:
                        break  # idle, but an observer wants the engine's state now
                    self._wakeup.wait(due_in)
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                if isinstance(command, _Add):
                    self._add(command)
                elif isinstance(command, EngineCall):
                    command.run(self.engine)
                else:
                    for request_id in command.request_ids:
                        self._abort(request_id)
            if self.engine.has_unfinished_requests():
                self._step()
            else:
                self._publish_stats()
            self._notify_observers()

    def _notify_observers(self) -> None:
        """A failing observer is a bug in a view of the engine, not in serving: it is logged and
        removed, and the requests go on."""
        for observer in list(self.observers):
            try:
                observer.observe(self.engine)
            except Exception:
                logger.exception("engine observer %r failed; it is detached", observer)
                self.observers.remove(observer)

    def _observers_due_in(self) -> float | None:
        """Seconds until the first observer wants to look again although nothing ran (None: never)."""
        delays = [d for d in (o.due_in() for o in self.observers) if d is not None]
        return min(delays, default=None)

    def _add(self, command: _Add) -> None:
        """Admit every prompt of the command, or none (a refused one withdraws the others).
        An engine that can no longer run steps (a failed rank) admits nothing: 503 at once."""
        try:
            self.engine.check_health()
        except Exception as err:
            _settle(command.accepted, Aborted(f"engine unhealthy: {err}"))
            return
        waiting, arriving = self.engine.stats().waiting, len(command.prompts)
        if self.max_waiting is not None and waiting + arriving > self.max_waiting:
            _settle(command.accepted, QueueFullError(waiting, arriving, self.max_waiting))
            return
        added: list[str] = []
        error: Exception | None = None
        for index, (request_id, prompt) in enumerate(zip(command.request_ids, command.prompts, strict=True)):
            try:
                self.engine.add_request(
                    request_id,
                    prompt,
                    command.params,
                    command.priority,
                    command.client_request_id,
                    grammar=command.grammar,
                    cache_salt=command.cache_salt,
                    lora_request=command.lora_request,
                )
            except InvalidRequestError as err:  # the handler turns it into a 400
                error = err if arriving == 1 else InvalidRequestError(f"prompt {index}: {err}", err.param)
            except Exception:  # a bug: this request fails (500, logged here only), the others go on
                logger.exception("add_request failed for %s", request_id)
                error = EngineRequestError(request_id)
            if error is not None:
                for added_id in added:
                    self.engine.abort(added_id)
                _settle(command.accepted, error)
                return
            added.append(request_id)
        for index, request_id in enumerate(added):
            self._live[request_id] = _Live(command.stream, index, command.submitted)
        self._publish_stats()  # a client that was admitted sees itself in /metrics
        _settle(command.accepted, None)

    def _abort(self, request_id: str, reason: BaseException | None = None) -> None:
        live = self._live.pop(request_id, None)
        if self.engine.abort(request_id) and live is not None:
            self.metrics.observe_finished(time.monotonic() - live.submitted, "abort")
        if live is not None and reason is not None:
            live.stream.put(live.tag, reason)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # a bug outside sampling: fail the requests in flight, keep the server up
            logger.exception("the engine step failed; aborting requests %s", sorted(self._live))
            for request_id in list(self._live):
                self._abort(request_id, Aborted("the engine failed while running this request"))
            outputs = []
        self._publish_stats()  # before any client sees this step's tokens
        now = time.monotonic()
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            self._observe(live, output, now)
            if output.finished:  # counted before the client can see its end
                del self._live[output.request_id]
                self.metrics.observe_finished(now - live.submitted, _finish_reason(output))
            live.stream.put(live.tag, output)

    def _observe(self, live: _Live, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens == live.num_tokens:
            return
        if live.last_token is None:
            self.metrics.observe_ttft(now - live.submitted)
        else:
            self.metrics.observe_itl(now - live.last_token)
        live.last_token, live.num_tokens = now, num_tokens

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        kv_stats = stats.kv_stats()
        self._peak_utilization = max(self._peak_utilization, kv_stats["utilization"])
        self._spec_decoding = stats.spec_decoding
        self._stats = {
            **kv_stats,
            "peak_utilization": self._peak_utilization,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generated_tokens,
        }
