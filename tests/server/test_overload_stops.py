"""Stop lists under the default limits, against a real server with the default 1 MiB body limit.

A list over a limit (strings, their characters, token ids) is a 400 naming the field and the
limit, also the issue's flood of 80,000 strings or 450,000 ids in one body; a request with every
list at its limit is served exactly (cut before the earliest stop string, streamed or not), and
every block returns to the pool.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pagedkv import SamplingParams
from pagedkv.engine import EngineConfig, RequestLimits
from pagedkv.server import ServerThread, create_app
from tests.server.helpers import API_KEY, ENGINE_OPTIONS, MODEL, assert_pool_whole, prompts, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
LIMITS = RequestLimits()


@pytest.fixture(scope="module")
def stops_server():
    """The default request limits and body size limit: what a deployer gets without flags."""
    with ServerThread(create_app(EngineConfig(**ENGINE_OPTIONS), api_key=API_KEY)) as server:
        yield server


def _post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    content = json.dumps({"model": MODEL, **body}, separators=(",", ":")).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, headers=AUTH, timeout=60)


def _decoys(count: int, chars: int) -> list[str]:
    """``count`` strings of ``chars`` characters in all that the model never writes."""
    sizes = [chars // count + (i < chars % count) for i in range(count)]
    return [f"\u2603{i:03d}".ljust(size, "~") for i, size in enumerate(sizes)]


OVER_LIMITS = {
    "one string more than max_stop_strings": (
        {"stop": [f"s{i}" for i in range(LIMITS.max_stop_strings + 1)]},
        "stop",
        f"max_stop_strings = {LIMITS.max_stop_strings} (--max-stop-strings)",
    ),
    "one character more than max_stop_chars": (
        {"stop": _decoys(2, LIMITS.max_stop_chars + 1)},
        "stop",
        f"max_stop_chars = {LIMITS.max_stop_chars} (--max-stop-chars)",
    ),
    "one id more than max_stop_token_ids": (
        {"stop_token_ids": list(range(LIMITS.max_stop_token_ids + 1))},
        "stop_token_ids",
        f"max_stop_token_ids = {LIMITS.max_stop_token_ids} (--max-stop-token-ids)",
    ),
    "80,000 stop strings": (
        {"stop": [f"{i:05d}" for i in range(80_000)], "max_tokens": 1000},
        "stop",
        "stop holds 80000 strings",
    ),
    "450,000 stop_token_ids": (
        {"stop_token_ids": [i % 10 for i in range(450_000)], "max_tokens": 1000},
        "stop_token_ids",
        "stop_token_ids holds 450000 ids",
    ),
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("case", OVER_LIMITS, ids=list(OVER_LIMITS))
def test_a_stop_list_over_its_limit_gets_400_naming_it(stops_server, case, path):
    fields, param, says = OVER_LIMITS[case]
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": "def"}], "max_tokens": 4, **fields}
    else:
        body = {"prompt": "def", "max_tokens": 4, **fields}
    assert len(json.dumps(body, separators=(",", ":"))) < 1 << 20  # within the body limit
    response = _post(stops_server, body, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert says in error["message"]
    wait_idle(stops_server.base_url)
    assert_pool_whole(stops_server.app.state.engine.engine)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_stop_list_at_its_limit_is_served_exactly(stops_server, reference, stream):
    """128 stop strings of 8,192 characters in all, one of them generated mid-way, and 1,024
    stop_token_ids the model never writes: the text ends before that string."""
    prompt = prompts(1, seed=33)[0]
    options = dict(max_tokens=40, seed=5, ignore_eos=True)
    free = reference.generate([prompt], SamplingParams(**options), use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert free.text.find(stop) > 0  # the cut leaves some text
    stops = [*_decoys(LIMITS.max_stop_strings - 1, LIMITS.max_stop_chars - len(stop)), stop]
    unused = sorted(set(range(reference.tokenizer.vocab_size)) - set(free.token_ids))
    stop_token_ids = unused[: LIMITS.max_stop_token_ids]
    assert (len(stops), sum(map(len, stops)), len(stop_token_ids)) == (128, 8192, 1024)

    body = dict(prompt=prompt, stop=stops, stop_token_ids=stop_token_ids, stream=stream, **options)
    response = _post(stops_server, body)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        choices = [json.loads(event)["choices"][0] for event in events[:-1]]
        text, finish_reason = "".join(c["text"] for c in choices), choices[-1]["finish_reason"]
    else:
        choice = response.json()["choices"][0]
        text, finish_reason = choice["text"], choice["finish_reason"]
    assert (text, finish_reason) == (free.text[: free.text.find(stop)], "stop")
    wait_idle(stops_server.base_url)
    assert_pool_whole(stops_server.app.state.engine.engine)


def test_a_stop_token_id_among_the_most_allowed_ends_the_text_there(stops_server, reference):
    prompt = prompts(1, seed=34)[0]
    options = dict(max_tokens=30, seed=6, ignore_eos=True)
    free = reference.generate([prompt], SamplingParams(**options), use_tqdm=False)[0].outputs[0]
    at = len(free.token_ids) // 2
    unused = sorted(set(range(reference.tokenizer.vocab_size)) - set(free.token_ids))
    stop_token_ids = [*unused[: LIMITS.max_stop_token_ids - 1], free.token_ids[at]]

    response = _post(stops_server, dict(prompt=prompt, stop_token_ids=stop_token_ids, **options))
    assert response.status_code == 200, response.text
    body = response.json()
    first = free.token_ids.index(free.token_ids[at])  # the id may occur before ``at``
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == first + 1
    assert body["choices"][0]["text"] == reference.tokenizer.decode(free.token_ids[: first + 1])
    wait_idle(stops_server.base_url)
    assert_pool_whole(stops_server.app.state.engine.engine)
