"""The deployer's limits on structured output, from the command line to a 400 that names them.

A spec over ``--structured-outputs-max-spec-chars`` or nested past
``--structured-outputs-max-schema-depth`` is refused before any compile; one still compiling
after ``--structured-outputs-max-compile-seconds`` is refused then, and from then on at once.
Nothing is queued and no block is taken; the render routes refuse exactly the same requests.
"""

from __future__ import annotations

import argparse

import httpx
import pytest

from pagedkv.cli_args import engine_options
from pagedkv.engine import EngineConfig
from pagedkv.engine.structured.config import StructuredOutputsConfig
from pagedkv.server import ServerThread, create_app
from pagedkv.server.cli import add_serve_parser
from tests.server.helpers import MODEL, assert_pool_whole, wait_idle

LIMITS = StructuredOutputsConfig(max_spec_chars=200, max_schema_depth=4, max_compile_seconds=1e-9)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser


def test_the_flags_set_the_engines_structured_outputs_config():
    args = _parser().parse_args(
        ["serve", "--structured-outputs-max-compile-seconds", "2.5", "--structured-outputs-max-spec-chars",
         "1000", "--structured-outputs-max-schema-depth", "8", "--structured-outputs-cache-size", "16",
         "--structured-outputs-compile-threads", "2", "--structured-outputs-disable-any-whitespace",
         "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )  # fmt: skip
    assert engine_options(args)["structured_outputs_config"] == StructuredOutputsConfig(
        max_spec_chars=1000,
        max_schema_depth=8,
        max_compile_seconds=2.5,
        cache_size=16,
        compile_threads=2,
        disable_any_whitespace=True,
    )
    assert (
        engine_options(_parser().parse_args(["serve"]))["structured_outputs_config"]
        == StructuredOutputsConfig()
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")
    loose = _parser().parse_args(["serve", "--structured-outputs-any-whitespace"])
    assert engine_options(loose)["structured_outputs_config"] == StructuredOutputsConfig(any_whitespace=True)


def test_bad_flags_are_usage_errors(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--structured-outputs-max-compile-seconds", "0"])
    assert "must be positive" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(num_kv_blocks=64, max_model_len=128, structured_outputs_config=LIMITS)
    with ServerThread(create_app(config)) as running:
        yield running


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/completions/render"])
@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"guided_regex": "a" * 201}, "guided_regex", "over the limit max_spec_chars = 200"),
        (
            {"structured_outputs": {"json": {"properties": {"a": {"properties": {"b": {}}}}}}},
            "structured_outputs.json",
            "over the limit max_schema_depth = 4",
        ),
        ({"guided_choice": ["yes", "no"]}, "guided_choice", "too costly to compile"),
    ],
    ids=["spec chars", "schema depth", "compile seconds"],
)
def test_a_spec_over_a_limit_is_refused_naming_the_field_and_the_limit(server, path, fields, param, says):
    body = {"model": MODEL, "prompt": "x = ", "max_tokens": 4, **fields}
    for _ in range(2):  # the second time from the compiler's memory of the refusal
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"], error
    wait_idle(server.base_url)
    assert_pool_whole(server.app.state.engine.engine)
