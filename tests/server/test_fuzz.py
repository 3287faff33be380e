"""The real ``pagedkv serve`` process under schemathesis, and its memory under hostile prompts.

Schemathesis generates requests from the server's own ``/openapi.json`` -- bodies that fit the
schema and bodies that break it -- for a bounded, derandomized number of examples per route.
Whatever it sends, the server answers within the timeout, never with a 5xx other than the
documented 503, always as its OpenAPI document says; afterwards nothing runs or waits, every KV
block is back in the pool and the resident memory has not grown past a bound.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.helpers import MODEL, wait_idle
from tests.server.process import ServeProcess

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
#: Small limits keep every generated request cheap: short contexts, few samples.
SERVER_OPTIONS = ("--api-key", API_KEY, "--num-kv-blocks", "64", "--max-model-len", "128",
                  "--max-num-seqs", "16", "--max-n", "4", "--max-request-tokens", "2048",
                  "--max-prompts-per-request", "8")  # fmt: skip
ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions/render"),
    ("POST", "/v1/chat/completions/render"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]
#: Examples per route and generation mode: enough to reach every field, few enough for CI.
EXAMPLES = 50
CHECKS = [content_type_conformance, response_schema_conformance, status_code_conformance]
#: The only 5xx the server documents for a healthy engine: its queue is full.
OVERLOADED = 503
MiB = 1 << 20


@pytest.fixture(scope="module")
def server():
    with ServeProcess(*SERVER_OPTIONS) as running:
        yield running
    assert running.returncode == 0


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")


def _answer_without_server_errors(case, base_url: str, mode: GenerationMode) -> None:
    response = case.call(base_url=base_url, headers=AUTH, timeout=60)
    assert response.status_code < 500 or response.status_code == OVERLOADED, (
        f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
    )
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS
    case.validate_response(response, checks=checks, excluded_checks=[not_a_server_error])


#: Bodies that break the schema only exist where there is a body.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in ROUTES] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in ROUTES if m == "POST"
]


@pytest.mark.parametrize("method, path, mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_fuzzed_requests_get_documented_answers_and_leave_the_pool_whole(server, schema, method, path, mode):
    operation = schema[path][method]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        _answer_without_server_errors(case, server.base_url, mode)

    fuzz()
    wait_idle(server.base_url, timeout=60)
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def _big_prompt(seed: int) -> str:
    """~1 MiB of words: what the issue's probe sent, just under the default body limit."""
    words = ("paged", "attention", "keeps", "the", "cache", "in", "blocks", "of", "tokens", "while")
    text = " ".join(words[(seed + i * 7) % len(words)] for i in range(150_000))
    return text[: MiB - 200]


def test_rejected_one_mib_prompts_do_not_grow_the_server(server):
    """200 rejected ~1 MiB prompts against 200 short requests: RSS within 1.5x: a rejected
    prompt's buffers must not stay with the process."""
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as client:
        for i in range(200):
            body = {"model": MODEL, "prompt": f"short request {i}", "max_tokens": 4}
            assert client.post("/v1/completions", json=body).status_code == 200
        wait_idle(server.base_url)
        after_short = server.rss_bytes()
        for i in range(200):
            response = client.post("/v1/completions", json={"model": MODEL, "prompt": _big_prompt(i)})
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "prompt"
        wait_idle(server.base_url)
        after_big = server.rss_bytes()
    assert after_big <= 1.5 * after_short, (after_short / MiB, after_big / MiB)
