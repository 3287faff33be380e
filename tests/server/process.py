"""``pagedkv serve`` as a user runs it: a real process on a free loopback port.

Tests that measure the server itself (its memory, its exit status, its stderr) need it in its
own process: an in-process server's RSS would include the test's clients and fixtures.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server.helpers import wait_until

#: ``pagedkv serve`` without pagedkv/cli.py (which wires it in): the same parser and function.
SERVE = (
    "import argparse, sys\n"
    "from pagedkv.server.cli import add_serve_parser\n"
    "parser = argparse.ArgumentParser()\n"
    "add_serve_parser(parser.add_subparsers())\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """``with ServeProcess("--num-kv-blocks", "64") as server: httpx.get(server.base_url + ...)``.

    Leaving the block sends SIGINT (a user's Ctrl-C) and keeps the exit status and stderr.
    ``open_files``: the process's open-file limit (soft and hard, so it cannot raise it).
    ``log``: write stderr to this file, readable while the server runs (a pipe nobody reads
    would stall a server that logs much), rather than to a pipe read at exit.
    """

    def __init__(self, *options: str, open_files: int | None = None, log: Path | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        code = SERVE
        if open_files is not None:  # set by the child itself, first thing
            limit = f"({open_files}, {open_files})"
            code = f"import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, {limit})\n{SERVE}"
        command = [sys.executable, "-c", code, "serve", "--port", str(self.port), "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        self.log = log
        self._log_file = open(log, "w") if log is not None else None  # closed in __exit__
        self.process = subprocess.Popen(
            [*command, *options],
            stdout=subprocess.PIPE,
            stderr=self._log_file or subprocess.PIPE,
            text=True,
            env=env,
        )
        self.returncode: int | None = None
        self.stderr = ""

    def _healthy(self) -> bool:
        assert self.process.poll() is None, self.process.communicate()
        try:
            return httpx.get(f"{self.base_url}/health").status_code == 200
        except httpx.TransportError:
            return False

    def rss_bytes(self) -> int:
        """The server process's resident set size, from /proc."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def __enter__(self) -> ServeProcess:
        try:
            wait_until(self._healthy, 120, "pagedkv serve to start")
        except BaseException:
            self.process.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGINT)
        _, stderr = self.process.communicate(timeout=30)
        self.returncode = self.process.returncode
        if self._log_file is not None:
            self._log_file.close()
            stderr = self.log.read_text()
        self.stderr = stderr
