"""``pagedkv serve`` as a user runs it: a real process, its options, its startup note."""

from __future__ import annotations

import argparse

import httpx
import pytest

from pagedkv.cli_args import engine_options, request_limits
from pagedkv.engine import RequestLimits
from pagedkv.models import BUILTIN_NOTE
from pagedkv.server.cli import API_KEY_ENV, add_serve_parser
from tests.server.helpers import MODEL
from tests.server.process import ServeProcess


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


def test_serve_takes_the_request_limits():
    args = _parser().parse_args(["serve", "--max-n", "8", "--max-request-tokens", "4096"])
    assert request_limits(args) == RequestLimits(max_n=8, max_request_tokens=4096)
    assert args.max_prompts_per_request == 256
    assert request_limits(_parser().parse_args(["serve"])) == RequestLimits()


def test_serve_takes_the_scheduling_options():
    args = _parser().parse_args(["serve", "--scheduling-policy", "priority", "--max-running-share", "0.25"])
    assert engine_options(args)["scheduling_policy"] == "priority"
    assert engine_options(args)["max_running_share"] == 0.25
    defaults = engine_options(_parser().parse_args(["serve"]))
    assert (defaults["scheduling_policy"], defaults["max_running_share"]) == ("fcfs", 0.5)
    assert (defaults["min_priority"], defaults["max_priority"]) == (-100, 100)
    bounded = engine_options(_parser().parse_args(["serve", "--min-priority", "0", "--max-priority", "9"]))
    assert (bounded["min_priority"], bounded["max_priority"]) == (0, 9)


def test_serve_takes_the_stop_list_limits():
    flags = ["--max-stop-strings", "8", "--max-stop-chars", "100", "--max-stop-token-ids", "16"]
    args = _parser().parse_args(["serve", *flags])
    assert request_limits(args) == RequestLimits(
        max_stop_strings=8, max_stop_chars=100, max_stop_token_ids=16
    )


@pytest.mark.parametrize(
    "option",
    [
        ["--max-body-size", "lots"],
        ["--block-size", "0"],
        ["--port", "x"],
        ["--max-n", "0"],
        ["--max-prompts-per-request", "-1"],
        ["--max-running-share", "0"],
        ["--max-running-share", "1.5"],
        ["--scheduling-policy", "lifo"],
        ["--min-priority", "low"],
    ],
)
def test_serve_refuses_bad_options(option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["serve", *option])
    assert exit_info.value.code == 2
    assert option[0] in capsys.readouterr().err


def test_serve_process_serves_and_shuts_down_cleanly():
    options = ["--api-key", "k", "--num-kv-blocks", "32", "--max-model-len", "128"]
    with ServeProcess(*options) as server:
        base_url = server.base_url
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(f"{base_url}/v1/models", headers=headers).json()["data"][0]["id"] == MODEL
        assert httpx.get(f"{base_url}/v1/models").status_code == 401
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
        completion = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert completion.json()["usage"]["completion_tokens"] <= 3
    assert server.returncode == 0
    assert BUILTIN_NOTE in server.stderr
    assert f"http://127.0.0.1:{server.port}/v1" in server.stderr


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--lora-modules", "a=/x"], "need --enable-lora"),
        (["--enable-lora", "--lora-modules", "no-path"], "name=path"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], '"name" and "path"'),
    ],
)
def test_serve_refuses_bad_lora_modules_before_loading(option, message, capsys):
    from pagedkv.server.cli import app_options

    args = _parser().parse_args(["serve", *option])
    with pytest.raises(SystemExit):
        app_options(args)
    assert message in capsys.readouterr().err
