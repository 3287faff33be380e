"""Run an app under uvicorn in a background thread: for tests and the in-process benchmark.

The socket is bound here, before uvicorn starts, so port 0 gives a free port with no race, and
:attr:`ServerThread.base_url` is known as soon as the constructor returns.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI


class Server(uvicorn.Server):
    """uvicorn's server, ending the dashboard's streams when it shuts down.

    On Ctrl-C uvicorn waits for every open response to finish before it stops the app, and a
    dashboard's event stream never finishes by itself: without this an open page would keep
    the server from exiting.
    """

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        dashboard = getattr(getattr(self.config.app, "state", None), "dashboard", None)
        if dashboard is not None:
            dashboard.close()
        await super().shutdown(sockets)


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.base_url + "/health")``."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self.app = app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
        self.server = Server(config)
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
