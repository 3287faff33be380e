"""Connection hygiene for uvicorn: read deadlines, a cap on open connections, bounded logs.

uvicorn never times out a client that is still sending its request (its keep-alive timer is
cancelled by every byte that arrives), so a client that sends a header byte every few seconds
holds a connection and a file descriptor for ever; and when descriptors run out, asyncio logs a
traceback for every failed ``accept()`` (up to ``backlog`` of them each time it retries).

Here every connection is, as h11 sees its client, in one of three phases:

* **header**: waiting for a request line and headers -- a new connection, or a kept-alive one
  after its response. The headers must be complete within ``timeout_request_header`` seconds of
  the phase starting (uvicorn's ``timeout_keep_alive`` still closes a silent one sooner).
* **body**: the headers arrived, the body has not; it must be complete within
  ``timeout_request_body`` seconds of the headers.
* **busy**: the request is read and the app answers it; no deadline (generation takes as long as
  it takes, and a request that waits too long is the app's business).

Past a deadline the connection is closed, with a ``408`` when a request was under way. At most
``max_connections`` are open: a connection past the cap closes the one that has been reading
its request the longest (a slow client's, or an idle kept-alive one) with a ``503``, so a client
that sends its request at once is always admitted; only when every connection is busy does the
new one get the ``503``. The cap and the accept backlog are sized below the open-file limit so
that ``accept()`` does not run out of descriptors; if it does anyway, :class:`AcceptErrorLog`
logs it once per interval. What the guard closed, and uvicorn's warnings about bad requests
(:class:`RepeatedWarnings`), are logged once per interval too (:mod:`pagedkv.log_limits`).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv.log_limits import LOG_INTERVAL_S, Throttle, held_note
from pagedkv.server.errors import APIError

logger = logging.getLogger("pagedkv.server")

HEADER, BODY = "header", "body"
#: Descriptors kept for everything but client connections: the listening socket, standard
#: streams and logs, the model's files, the engine's pipes and sockets.
FD_OVERHEAD = 64
#: The most connections allowed by default, whatever the open-file limit (each costs memory).
DEFAULT_MAX_CONNECTIONS = 16384
#: uvicorn's accept backlog, the most a descriptor limit can spare for it.
MAX_BACKLOG = 2048
#: ``accept()`` failures that mean "out of descriptors or memory", not a bad client.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class ConnectionLimits:
    """What ``pagedkv serve`` and :class:`~pagedkv.server.runner.ServerThread` allow a client.

    Times are in seconds. ``limit_concurrency``: the most open connections (None: sized from the
    open-file limit, :func:`plan_descriptors`). ``h11_max_incomplete_event_size``: the most
    bytes of a request line and headers (more gets 400).
    """

    timeout_keep_alive: float = 5.0
    timeout_request_header: float = 10.0
    timeout_request_body: float = 30.0
    limit_concurrency: int | None = None
    h11_max_incomplete_event_size: int = 16 * 1024

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "timeout_request_header", "timeout_request_body"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be positive, got {self.limit_concurrency}")
        size = self.h11_max_incomplete_event_size
        if size < 1024:
            raise ValueError(f"h11_max_incomplete_event_size must be at least 1024, got {size}")


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # a hard limit the kernel refuses (over fs.nr_open)
            pass
    return open_file_limit()


def open_file_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def plan_descriptors(limits: ConnectionLimits, file_limit: int) -> tuple[int, int, int]:
    """``(max_connections, backlog, fits)`` for a process that may open ``file_limit`` files.

    asyncio accepts up to ``backlog`` connections in one go before any of them can be closed,
    so the cap leaves room for a backlog and :data:`FD_OVERHEAD`: ``fits`` is the largest cap
    that does, the default cap is that (at most :data:`DEFAULT_MAX_CONNECTIONS`).
    """
    backlog = max(16, min(MAX_BACKLOG, file_limit // 8))
    fits = max(1, file_limit - backlog - FD_OVERHEAD)
    cap = limits.limit_concurrency or min(fits, DEFAULT_MAX_CONNECTIONS)
    return cap, backlog, fits


def _raw_response(error: APIError) -> bytes:
    """A complete HTTP/1.1 response carrying ``error``, after which the connection closes."""
    status = HTTPStatus(error.status)
    body = json.dumps(error.body()).encode()
    retry = "retry-after: 1\r\n" if status == HTTPStatus.SERVICE_UNAVAILABLE else ""
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\nx-content-type-options: nosniff\r\n"
        f"{retry}\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """One server's connections that are reading a request, per phase, oldest first.

    Event loop only. Each phase's table maps a connection to when it entered the phase; dicts
    keep insertion order and a connection re-enters at the end, so the first entry is the
    oldest and, the phase's timeout being one number, the first to expire.
    """

    def __init__(self, limits: ConnectionLimits, max_connections: int) -> None:
        self.max_connections = max_connections
        self._reading: dict[str, dict[GuardedH11Protocol, float]] = {HEADER: {}, BODY: {}}
        self._timeouts = {HEADER: limits.timeout_request_header, BODY: limits.timeout_request_body}
        #: What the guard closed since start: ``header`` / ``body`` (a deadline), ``evicted``
        #: (to admit a new connection), ``refused`` (503: every connection was busy).
        self.closed: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()
        self._last_report = -float("inf")

    def protocol(self, **uvicorn_arguments: Any) -> GuardedH11Protocol:
        """uvicorn's ``http`` protocol factory: one connection."""
        return GuardedH11Protocol(guard=self, **uvicorn_arguments)

    def enter(self, connection: GuardedH11Protocol, phase: str | None) -> None:
        for table in self._reading.values():
            table.pop(connection, None)
        if phase is not None:
            self._reading[phase][connection] = time.monotonic()

    def admit(self, connection: GuardedH11Protocol, open_connections: int) -> bool:
        """Make room for a new connection; False when it is to be refused instead."""
        if open_connections <= self.max_connections:
            return True
        heads = [(next(iter(table.items())), phase) for phase, table in self._reading.items() if table]
        if not heads:
            self.closed["refused"] += 1
            return False
        (oldest, _), phase = min(heads, key=lambda head: head[0][1])
        self.closed["evicted"] += 1
        oldest.drop(phase, _overloaded(self.max_connections))
        return True

    def sweep(self) -> None:
        """Close every connection past its phase's deadline; now and then log what was closed."""
        now = time.monotonic()
        for phase, table in self._reading.items():
            timeout = self._timeouts[phase]
            while table:
                connection, since = next(iter(table.items()))
                if now - since < timeout:
                    break
                self.closed[phase] += 1
                connection.drop(phase, _too_slow(phase, timeout))
        if self.closed != self._reported and now - self._last_report >= LOG_INTERVAL_S:
            self._log(self.closed - self._reported, now)

    def _log(self, new: Counter[str], now: float) -> None:
        header_s, body_s = self._timeouts[HEADER], self._timeouts[BODY]
        parts = []
        if new[HEADER]:
            parts.append(f"{new[HEADER]} that sent no complete request headers within {header_s:g} s")
        if new[BODY]:
            parts.append(f"{new[BODY]} whose request body took over {body_s:g} s")
        if new["evicted"]:
            parts.append(f"{new['evicted']} still reading a request, to admit new ones")
        if new["refused"]:
            parts.append(f"{new['refused']} new ones with 503 (every connection was busy)")
        if parts:
            logger.warning("closed %s (--limit-concurrency %d)", "; ".join(parts), self.max_connections)
        self._reported, self._last_report = self.closed.copy(), now


def _too_slow(phase: str, timeout: float) -> APIError:
    part = "headers" if phase == HEADER else "body"
    return APIError(
        HTTPStatus.REQUEST_TIMEOUT,
        f"the request's {part} did not arrive within {timeout:g} s",
        code="request_timeout",
    )


def _overloaded(max_connections: int) -> APIError:
    return APIError(
        HTTPStatus.SERVICE_UNAVAILABLE,
        f"the server has its limit of {max_connections} open connections; retry later",
        type="server_overloaded",
        code="too_many_connections",
    )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol telling its guard which phase it is in, and closable by it."""

    def __init__(self, guard: ConnectionGuard, **uvicorn_arguments: Any) -> None:
        super().__init__(**uvicorn_arguments)
        self.guard = guard
        self._phase: str | None = None
        #: Over the cap with nobody to close: answer 503 as soon as the request arrives (it is
        #: read first, so that closing does not reset the connection under the response).
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._refused = not self.guard.admit(self, len(self.connections))
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.enter(self, None)
        self._phase = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self.drop(HEADER, _overloaded(self.guard.max_connections))
            return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._track()

    def _track(self) -> None:
        """Follow h11's view of the client: IDLE is between requests, SEND_BODY mid-body."""
        state = self.conn.their_state
        phase = HEADER if state is h11.IDLE else BODY if state is h11.SEND_BODY else None
        if self.transport.is_closing():
            phase = None
        if phase != self._phase:
            self._phase = phase
            self.guard.enter(self, phase)

    def drop(self, phase: str, error: APIError) -> None:
        """Close the connection; answer ``error`` if the client is mid-request and has no answer."""
        self.guard.enter(self, None)
        self._phase = None
        cycle = self.cycle if phase == BODY else None
        if phase == HEADER:
            answer = self._refused or bool(self.conn.trailing_data[0])  # part of a request came
        else:
            answer = cycle is not None and not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() says so; what it sends is dropped
            cycle.message_event.set()
        if not self.transport.is_closing():
            if answer:
                self.transport.write(_raw_response(error))
            self.transport.close()


class RepeatedWarnings(logging.Filter):
    """On uvicorn's error log: the warnings it writes once per bad request (malformed, or asking
    for a protocol upgrade) pass once per interval, with how many were held back.

    A flood of bad requests would otherwise write a line per connection.
    """

    MESSAGES = frozenset(
        {
            "Invalid HTTP request received.",
            "Unsupported upgrade request.",
            "No supported WebSocket library detected. Please use \"pip install 'uvicorn[standard]'\", "
            "or install 'websockets' or 'wsproto' manually.",
        }
    )

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        super().__init__()
        self.throttle = Throttle(interval)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.msg not in self.MESSAGES:
            return True
        held = self.throttle.admit(record.msg)
        if held is None:
            return False
        record.msg += held_note(held)
        return True


#: One for the process: uvicorn's loggers are the process's.
REPEATED_WARNINGS = RepeatedWarnings()


class AcceptErrorLog:
    """The event loop's exception handler: accept errors once per interval, the rest as usual.

    asyncio reports every failed ``accept()``, and on running out of descriptors fails up to
    ``backlog`` of them each time it retries (every second): a flood of connections would
    write megabytes of identical tracebacks a minute.
    """

    def __init__(self, guard: ConnectionGuard, interval: float = LOG_INTERVAL_S) -> None:
        self.guard = guard
        self.throttle = Throttle(interval)
        self.failures = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        accepting = "accept" in context.get("message", "")
        if not (accepting and isinstance(error, OSError) and error.errno in _RESOURCE_ERRNOS):
            loop.default_exception_handler(context)
            return
        self.failures += 1
        held = self.throttle.admit("accept")
        if held is not None:
            logger.error(
                "cannot accept connections: %s (%d times since the last report); open-file limit "
                "%d, --limit-concurrency %d: raise the limit (ulimit -n) or lower the cap",
                error.strerror,
                held + 1,
                open_file_limit(),
                self.guard.max_connections,
            )
