"""``pagedkv serve`` as a user runs it: a real process, its options, its startup note."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from pagedkv.models import BUILTIN_NOTE
from pagedkv.server.cli import API_KEY_ENV, add_serve_parser
from tests.server.helpers import MODEL, wait_until

#: ``pagedkv serve`` without pagedkv/cli.py (which wires it in): the same parser and function.
SERVE = (
    "import argparse, sys\n"
    "from pagedkv.server.cli import add_serve_parser\n"
    "parser = argparse.ArgumentParser()\n"
    "add_serve_parser(parser.add_subparsers())\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser


def test_serve_binds_to_loopback_by_default(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = _parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.max_body_size == 1 << 20 and args.func is args.run


def test_serve_reads_the_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _parser().parse_args(["serve"]).api_key == "from-env"


@pytest.mark.parametrize("option", [["--max-body-size", "lots"], ["--block-size", "0"], ["--port", "x"]])
def test_serve_refuses_bad_options(option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["serve", *option])
    assert exit_info.value.code == 2
    assert option[0] in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_process_serves_and_shuts_down_cleanly():
    port = _free_port()
    command = [sys.executable, "-c", SERVE, "serve", "--port", str(port), "--api-key", "k",
               "--num-kv-blocks", "32", "--max-model-len", "128", "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    base_url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, process.communicate()
        try:
            return httpx.get(f"{base_url}/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, 90, "pagedkv serve to start")
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(f"{base_url}/v1/models", headers=headers).json()["data"][0]["id"] == MODEL
        assert httpx.get(f"{base_url}/v1/models").status_code == 401
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
        completion = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert completion.json()["usage"]["completion_tokens"] <= 3
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0
    assert BUILTIN_NOTE in stderr
    assert f"http://127.0.0.1:{port}/v1" in stderr
