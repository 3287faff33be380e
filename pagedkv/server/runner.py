"""Run an app under uvicorn: :class:`Server` for ``pagedkv serve``, :class:`ServerThread` in a
background thread for tests and the in-process benchmark -- both with the same connection limits
(:mod:`pagedkv.server.connections`).

ServerThread binds its socket before uvicorn starts, so port 0 gives a free port with no race,
and :attr:`ServerThread.base_url` is known as soon as the constructor returns.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

from pagedkv.server.connections import (
    REPEATED_WARNINGS,
    AcceptErrorLog,
    ConnectionGuard,
    ConnectionLimits,
    open_file_limit,
    plan_descriptors,
)

logger = logging.getLogger("pagedkv.server")


class Server(uvicorn.Server):
    """uvicorn's server with read deadlines and a connection cap, ending the dashboard's streams
    when it shuts down.

    ``options`` go to ``uvicorn.Config`` (host, port, log_level, ...). On Ctrl-C uvicorn waits for
    every open response to finish before it stops the app, and a dashboard's event stream never
    finishes by itself: without :meth:`shutdown` an open page would keep the server from exiting.
    """

    def __init__(self, app: FastAPI, limits: ConnectionLimits | None = None, **options: Any) -> None:
        limits = limits or ConnectionLimits()
        file_limit = open_file_limit()
        max_connections, backlog, fits = plan_descriptors(limits, file_limit)
        if max_connections > fits:
            logger.warning(
                "--limit-concurrency %d leaves too few of the %d files this process may open for "
                "accepting connections (at most %d fit): accept errors will be logged under load",
                max_connections,
                file_limit,
                fits,
            )
        self.guard = ConnectionGuard(limits, max_connections)
        config = uvicorn.Config(
            app,
            http=self.guard.protocol,  # type: ignore[arg-type]  # a factory, as uvicorn calls it
            ws="none",  # no WebSocket routes: an upgrade request is an ordinary request
            timeout_keep_alive=limits.timeout_keep_alive,  # type: ignore[arg-type]
            h11_max_incomplete_event_size=limits.h11_max_incomplete_event_size,
            backlog=backlog,
            **options,
        )
        super().__init__(config)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrorLog(self.guard))
        uvicorn_errors = logging.getLogger("uvicorn.error")
        if REPEATED_WARNINGS not in uvicorn_errors.filters:
            uvicorn_errors.addFilter(REPEATED_WARNINGS)
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        self.guard.sweep()  # every tick: a tenth of a second
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        dashboard = getattr(getattr(self.config.app, "state", None), "dashboard", None)
        if dashboard is not None:
            dashboard.close()
        await super().shutdown(sockets)


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.base_url + "/health")``."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self.server = Server(app, limits, log_level=log_level, timeout_graceful_shutdown=5)
        self._thread = threading.Thread(target=self._serve, name="pagedkv-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        self.server.run(sockets=[self._socket])

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.base_url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
