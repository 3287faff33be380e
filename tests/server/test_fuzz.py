"""The real ``pagedkv serve`` process under schemathesis, and its memory under hostile prompts.

Schemathesis generates requests from the server's own ``/openapi.json`` -- bodies that fit the
schema and bodies that break it -- for a bounded, derandomized number of examples per route.
Whatever it sends, the server answers within the timeout, never with a 5xx other than the
documented 503, always as its OpenAPI document says; afterwards nothing runs or waits, every KV
block is back in the pool and the resident memory has not grown past a bound. The fields that
constrain the output (``response_format``, ``structured_outputs``, ``guided_*``, ``tools`` and
``tool_choice``) are in the schema, so schemathesis fills them too; a property test also throws
random specs of every kind at them -- arbitrary regexes, grammars, schemas, choice lists and tool
definitions -- and the answer must be a 200 or a 400 naming the field.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
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
#: Small limits keep every generated request cheap: short contexts, few samples. The context
#: holds the chat template's tools section with two generated tools.
SERVER_OPTIONS = ("--api-key", API_KEY, "--num-kv-blocks", "160", "--max-model-len", "1024",
                  "--max-num-seqs", "16", "--max-n", "4", "--max-request-tokens", "2048",
                  "--max-prompts-per-request", "8", "--structured-outputs-max-compile-seconds", "5",
                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # fmt: skip
ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions/render"),
    ("POST", "/v1/chat/completions/render"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
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


#: JSON values a schema may hold (small: a compile is per distinct spec).
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.sampled_from(["object", "string", "integer", "array", "x"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "properties", "items", "enum", "required", "maxLength", "a"]),
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)
_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"])}, optional={"parameters": _JSON}
        ),
    }
)
#: One way of constraining the output each, with the field a 400 must name.
_CONSTRAINTS = st.one_of(
    st.tuples(
        st.just("/v1/completions"),
        st.builds(lambda v: {"guided_regex": v}, st.text(max_size=12)),
        st.just("guided_regex"),
    ),
    st.tuples(
        st.just("/v1/completions"),
        st.builds(lambda v: {"guided_grammar": v}, st.text(max_size=24)),
        st.just("guided_grammar"),
    ),
    st.tuples(
        st.just("/v1/completions"),
        st.builds(lambda v: {"guided_choice": v}, st.lists(st.text(max_size=4), max_size=3)),
        st.just("guided_choice"),
    ),
    st.tuples(
        st.just("/v1/completions"),
        st.builds(lambda v: {"structured_outputs": {"json": v}}, _JSON),
        st.just("structured_outputs"),
    ),
    st.tuples(
        st.just("/v1/chat/completions"),
        st.builds(
            lambda v: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": v}}},
            _JSON,
        ),
        st.just("response_format"),
    ),
    st.tuples(
        st.just("/v1/chat/completions"),
        st.builds(
            lambda tools, choice: {"tools": tools, "tool_choice": choice},
            st.lists(_TOOL, max_size=2),
            st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
        ),
        st.just("tool"),
    ),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(case=_CONSTRAINTS)
def test_random_constraints_are_served_or_refused_naming_their_field(server, case):
    path, fields, field = case
    body = {"model": MODEL, "max_tokens": 8, **fields}
    if path == "/v1/completions":
        body["prompt"] = "x = "
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = httpx.post(f"{server.base_url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["param"].startswith(field), (fields, response.text)
    wait_idle(server.base_url, timeout=60)
