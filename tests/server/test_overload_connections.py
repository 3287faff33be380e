"""Slow, surplus and flooding clients against a real ``pagedkv serve``, and the security headers.

Three servers, started together: ``strict`` (read deadlines of 1 s, 256 open files, the cap it
sizes from them), ``capped`` (20 connections, deadlines long enough never to fire here) and
``starved`` (256 open files but a cap of 1000, so that ``accept()`` runs out of descriptors).
Every wait is for an event -- the server answering or closing a socket, a line in its log, its
open sockets in /proc -- under a generous bound; nothing asserts how fast the server is.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import re
import select
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from pagedkv.server.cli import add_serve_parser, connection_limits
from pagedkv.server.connections import ConnectionLimits
from tests.server.helpers import API_KEY, MODEL, wait_until
from tests.server.process import ServeProcess

KEY = "overload-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = ("--num-kv-blocks", "64", "--max-model-len", "128", "--api-key", KEY)
#: The start of a request whose headers never end.
PARTIAL_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
#: How long a test waits for the server to close a socket (its deadlines here are 1 s).
CLOSE_BOUND_S = 30.0
FILE_LIMIT = 256


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("overload-logs")
    started = {
        "strict": ServeProcess(
            *ENGINE,
            *("--timeout-request-header", "1", "--timeout-request-body", "1", "--timeout-keep-alive", "1"),
            open_files=FILE_LIMIT,
            log=logs / "strict.log",
        ),
        "capped": ServeProcess(
            *ENGINE,
            *(
                "--limit-concurrency",
                "20",
                "--timeout-request-header",
                "600",
                "--timeout-request-body",
                "600",
            ),
            log=logs / "capped.log",
        ),
        "starved": ServeProcess(
            *ENGINE,
            *("--limit-concurrency", "1000", "--timeout-request-header", "600"),
            open_files=FILE_LIMIT,
            log=logs / "starved.log",
        ),
    }
    with contextlib.ExitStack() as stack:
        for process in started.values():  # all three start at once; each is waited for here
            try:
                stack.enter_context(process)
            except BaseException:
                for other in started.values():
                    other.process.kill()
                raise
        yield SimpleNamespace(**started)


def connect(server: ServeProcess, timeout: float = CLOSE_BOUND_S) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=timeout)


def read_until_closed(sock: socket.socket, trickle: bool = False) -> bytes:
    """Everything the server sends until it closes; with ``trickle`` a byte is sent every 0.2 s
    meanwhile, as a slow client would (the server must close it all the same)."""
    received = b""
    deadline = time.monotonic() + CLOSE_BOUND_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.2)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk
        elif trickle:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b"a")
    raise AssertionError(f"the server kept the connection open for {CLOSE_BOUND_S} s; got {received!r}")


def still_open(sock: socket.socket) -> bool:
    """Nothing to read and no end of stream (the server neither answered nor closed)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def keyed_completion(server: ServeProcess) -> httpx.Response:
    body = {"model": MODEL, "prompt": "def f", "max_tokens": 2}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60)


def answers_keyed_requests(server: ServeProcess) -> bool:
    """A keyed completion succeeds (False, to try again, while the server is full)."""
    try:
        return keyed_completion(server).status_code == 200
    except httpx.TransportError:
        return False


def server_connections(server: ServeProcess) -> int:
    """Connections to the server's port that hold one of its sockets: established, or closed by
    the client and not yet by the server (the kernel's table, ``/proc/net/tcp``)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if int(local.split(":")[1], 16) == server.port and state in ("01", "08"):  # ESTABLISHED, CLOSE_WAIT
            count += 1
    return count


def log_text(server: ServeProcess) -> str:
    return server.log.read_text()


def test_the_serve_flags_default_to_the_connection_limits_the_in_process_server_uses():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert connection_limits(parser.parse_args(["serve"])) == ConnectionLimits()


# -- read deadlines ------------------------------------------------------------------------


def test_headers_sent_too_slowly_get_408_and_the_connection_is_closed(servers):
    with connect(servers.strict) as sock:
        sock.sendall(PARTIAL_HEADERS)
        status, error = status_and_error(read_until_closed(sock, trickle=True))
    assert status == 408
    assert error["code"] == "request_timeout"
    assert "headers did not arrive within 1 s" in error["message"]


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(servers):
    with connect(servers.strict) as sock:
        assert read_until_closed(sock) == b""


def test_a_body_sent_too_slowly_gets_408_and_the_connection_is_closed(servers):
    with connect(servers.strict) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{"
        )
        status, error = status_and_error(read_until_closed(sock, trickle=True))
    assert status == 408
    assert "body did not arrive within 1 s" in error["message"]
    assert keyed_completion(servers.strict).status_code == 200


def test_a_client_still_sending_a_body_after_its_answer_is_closed(servers):
    """Refused before its body was read (no key: 401), a client that goes on sending is closed."""
    with connect(servers.strict) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        response = read_until_closed(sock, trickle=True)
    assert status_and_error(response)[0] == 401


def test_a_body_over_the_limit_is_refused_and_the_connection_closed_unread(servers):
    with connect(servers.strict) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n"
        )
        response = read_until_closed(sock)  # without sending the body
    assert status_and_error(response)[0] == 413
    assert b"connection: close" in response.lower()


def test_an_idle_kept_alive_connection_is_closed(servers):
    with connect(servers.strict) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = read_until_closed(sock)  # after the answer, the keep-alive timeout
    assert response.startswith(b"HTTP/1.1 200")


# -- the connection cap --------------------------------------------------------------------


def test_past_the_cap_the_longest_reading_connection_makes_room(servers):
    server = servers.capped
    wait_until(lambda: server_connections(server) == 0, CLOSE_BOUND_S, "the earlier connections to close")
    slow = [connect(server) for _ in range(20)]
    try:
        for sock in slow:
            sock.sendall(PARTIAL_HEADERS)
        assert keyed_completion(server).status_code == 200  # the 21st connection
        status, error = status_and_error(read_until_closed(slow[0]))
        assert (status, error["code"]) == (503, "too_many_connections")
        assert all(still_open(sock) for sock in slow[1:])
    finally:
        for sock in slow:
            sock.close()


def test_with_every_connection_busy_a_new_one_gets_503(servers):
    server = servers.capped
    wait_until(lambda: server_connections(server) == 0, CLOSE_BOUND_S, "the earlier connections to close")
    streams = []
    try:
        stream = f"GET /dashboard/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n"
        for _ in range(20):  # dashboard streams: busy with their response for as long as they are open
            sock = connect(server)
            sock.sendall(stream.encode())
            streams.append(sock)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        with connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, error = status_and_error(read_until_closed(sock))
        assert (status, error["code"]) == (503, "too_many_connections")
        streams.pop().close()
        wait_until(lambda: answers_keyed_requests(server), CLOSE_BOUND_S, "room for a keyed request")
    finally:
        for sock in streams:
            sock.close()


# -- floods past the open-file limit --------------------------------------------------------


def test_a_flood_past_the_file_limit_leaves_room_for_a_keyed_request_and_a_short_log(servers):
    server = servers.strict
    log_before = len(log_text(server))
    flood: list[socket.socket] = []
    stop = threading.Event()

    def open_slow_connections() -> None:
        while not stop.is_set() and len(flood) < 3 * FILE_LIMIT:
            with contextlib.suppress(OSError):  # one the server closed at once
                sock = connect(server, timeout=5)
                flood.append(sock)
                sock.sendall(PARTIAL_HEADERS)

    flooding = threading.Thread(target=open_slow_connections)
    flooding.start()
    try:
        wait_until(lambda: len(flood) >= FILE_LIMIT, CLOSE_BOUND_S, "the flood to pass the file limit")
        assert keyed_completion(server).status_code == 200  # while connections keep coming
    finally:
        stop.set()
        flooding.join()
        for sock in flood:
            sock.close()
    assert len(flood) > FILE_LIMIT
    assert keyed_completion(server).status_code == 200
    grown = log_text(server)[log_before:]
    assert "Too many open files" not in grown
    assert "Traceback" not in grown
    assert len(grown) < 2000, grown  # a summary line per 10 s, not a line per connection


def test_a_burst_of_bad_requests_leaves_a_few_log_lines(servers):
    """uvicorn warns once per malformed or upgrade request; here once per 10 s, with a count."""
    server = servers.strict
    before, started = len(log_text(server)), time.monotonic()
    garbage = b"NOT HTTP AT ALL\r\n\r\n"
    upgrade = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
    for request, status in [(garbage, b"400"), (upgrade, b"200")] * 50:
        with connect(server) as sock:
            sock.sendall(request)
            assert sock.recv(65536).split(b" ")[1] == status  # an upgrade is served as plain HTTP
    intervals = 2 + int((time.monotonic() - started) // 10)
    grown = log_text(server)[before:]
    for message in ("Invalid HTTP request received.", "Unsupported upgrade request."):
        assert 1 <= grown.count(message) <= intervals, grown


def test_accept_errors_are_logged_once_per_interval(servers):
    """A cap above what the open files allow: accept() fails, and says so once, not per try."""
    server = servers.starved
    assert "--limit-concurrency 1000 leaves too few" in log_text(server)
    flood = []
    try:
        for _ in range(2 * FILE_LIMIT):
            if "cannot accept connections" in log_text(server):
                break
            with contextlib.suppress(OSError):  # past a full accept queue a connect can time out
                sock = connect(server, timeout=1)
                flood.append(sock)
                sock.sendall(PARTIAL_HEADERS)
        wait_until(lambda: "cannot accept connections" in log_text(server), CLOSE_BOUND_S, "accept errors")
    finally:
        for sock in flood:
            sock.close()
    wait_until(lambda: answers_keyed_requests(server), CLOSE_BOUND_S, "the server to answer again")
    log = log_text(server)
    assert "Traceback" not in log
    reports = re.findall(r"cannot accept connections: Too many open files \((\d+) times", log)
    assert 1 <= len(reports) <= 3, log  # the test lasts seconds: one report per 10 s
    assert len(log) < 4000, log


# -- headers -------------------------------------------------------------------------------


def sha256_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_the_dashboard_allows_only_its_own_script_and_style_and_no_framing(base_url):
    response = httpx.get(f"{base_url}/dashboard")
    assert response.status_code == 200
    header = response.headers["content-security-policy"]
    policy = dict(part.strip().split(" ", 1) for part in header.split(";"))
    (script,) = re.findall(r"<script>(.*?)</script>", response.text, re.DOTALL)
    (style,) = re.findall(r"<style>(.*?)</style>", response.text, re.DOTALL)
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == sha256_source(script)
    assert policy["style-src"] == sha256_source(style)
    assert policy["frame-ancestors"] == "'none'"
    assert policy["connect-src"] == "'self'"
    assert "unsafe" not in header
    assert " style=" not in response.text  # an inline style attribute would need 'unsafe-inline'
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["x-content-type-options"] == "nosniff"


def test_docs_pages_are_off_and_the_schema_is_served(base_url):
    for path in ("/docs", "/redoc"):
        assert httpx.get(base_url + path).status_code == 404
    schema = httpx.get(f"{base_url}/openapi.json")
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    assert schema.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/health", {}, 200),
        ("GET", "/v1/models", {}, 401),
        ("GET", "/v1/models", {"Authorization": f"Bearer {API_KEY}"}, 200),
        ("GET", "/nowhere", {}, 404),
        ("POST", "/v1/completions", {"Authorization": f"Bearer {API_KEY}"}, 400),
    ],
)
def test_every_answer_says_nosniff(base_url, method, path, headers, status):
    response = httpx.request(method, base_url + path, headers=headers, content=b"{")
    assert response.status_code == status
    assert response.headers["x-content-type-options"] == "nosniff"
