"""Bodies of many long prompts that will be refused: cheap checks first, tokenizing off the event loop.

The issue's reproduction -- two clients looping on 1 MiB bodies of 256 prompts of 3,900
characters -- held the event loop for seconds per body, so ``/health`` took seconds too. These
tests hold the tokenizer on a gate (the real tokenizer behind it) instead of racing it: while a
body is being tokenized ``/health`` must answer, the refusal must name the prompt and the limit,
and no prompt after the first one over a limit is ever tokenized.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedkv.engine import EngineConfig, RequestLimits
from pagedkv.server import ServerThread, create_app
from pagedkv.server.prompts import PromptEncoder
from tests.server.helpers import MODEL, assert_pool_whole, wait_idle

#: The built-in model's own context (4,096 tokens) and the default 1 MiB body limit, as served,
#: with a request budget set far above the pool's 8,192 tokens (that default would refuse these
#: bodies on their bounds alone, before any prompt is tokenized).
ENGINE = dict(
    num_kv_blocks=512, block_size=16, max_num_seqs=8, limits=RequestLimits(max_request_tokens=1 << 18)
)
PROMPTS = 256
CHARS = 3_900
_WORDS = "paged attention keeps the cache in blocks so that many requests share one pool".split()


def _text(seed: int, chars: int = CHARS) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(chars // 3))[:chars]


def _many(max_tokens: int, **replace: str) -> dict:
    """~1 MiB: 256 prompts of 3,900 characters (each ~1,250 tokens), some replaced by index."""
    batch = [_text(i) for i in range(PROMPTS)]
    for index, text in replace.items():
        batch[int(index)] = text
    return {"model": MODEL, "prompt": batch, "max_tokens": max_tokens}


class TokenizerGate:
    """The server's real tokenizer call behind a gate, counting the prompts it tokenizes.

    While closed, the tokenizer thread waits inside its first call (``entered`` is set then), as a
    slow tokenizer would, so a test can ask the server other things meanwhile without racing it.
    """

    def __init__(self, encoder: PromptEncoder) -> None:
        self.encoder = encoder
        self.calls = 0
        self.entered = threading.Event()
        self._open = threading.Event()

    def __enter__(self) -> TokenizerGate:
        self.encoder.encode_text = self._encode_text
        return self

    def __exit__(self, *exc) -> None:
        del self.encoder.encode_text
        self._open.set()

    def open(self) -> None:
        self._open.set()

    def _encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        self.entered.set()
        self._open.wait()
        return PromptEncoder.encode_text(self.encoder, text, add_special_tokens)


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(EngineConfig(**ENGINE))) as running:
        yield running


@pytest.fixture
def gate(server):
    with TokenizerGate(server.app.state.context.encoder) as holding:
        yield holding
    wait_idle(server.base_url)
    assert_pool_whole(server.app.state.engine.engine)


def test_the_issue_body_is_refused_before_any_prompt_is_tokenized(server, gate):
    gate.open()
    response = httpx.post(f"{server.base_url}/v1/completions", json=_many(max_tokens=4000), timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith("prompt 0: this model's maximum context length is 4096 tokens")
    assert "at least" in error["message"] and error["param"] == "max_tokens"
    assert gate.calls == 0


def test_health_answers_while_bodies_are_tokenized_and_tokenizing_stops_at_the_first_prompt_over(
    server, gate
):
    """Two clients' bodies wait on the held tokenizer; /health answers meanwhile. Prompt 7 is
    over the context only once tokenized (~4,200 tokens, a bound of a few hundred)."""
    body = _many(max_tokens=16, **{"7": _text(7, chars=13_000)})
    with ThreadPoolExecutor(2) as clients:
        big = [clients.submit(httpx.post, f"{server.base_url}/v1/completions", json=body, timeout=60)
               for _ in range(2)]  # fmt: skip
        assert gate.entered.wait(60), "the server never started tokenizing"
        for _ in range(5):
            assert httpx.get(f"{server.base_url}/health", timeout=30).json() == {"status": "ok"}
        assert not any(request.done() for request in big)  # both still wait on the tokenizer
        gate.open()
        responses = [request.result() for request in big]
    for response in responses:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["message"].startswith("prompt 7: this model's maximum context length is 4096 tokens")
        assert error["param"] == "prompt"
    assert gate.calls == 2 * 8  # prompts 0..7 of each body, none after the one over the context


def test_a_batch_over_its_token_budget_stops_tokenizing_once_it_provably_is(server, gate):
    """256 prompts of ~1,250 tokens are over --max-request-tokens (262,144) long before the last
    is tokenized: the bounds of the prompts still to come already say so."""
    gate.open()
    response = httpx.post(f"{server.base_url}/v1/completions", json=_many(max_tokens=16), timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "over the limit max_request_tokens = 262144" in error["message"]
    assert error["param"] == "max_tokens"
    assert 0 < gate.calls < PROMPTS


def test_two_clients_looping_on_refused_bodies_leave_health_answering(server):
    """The issue's load, ungated: every body gets its 400, every health check its 200."""
    body = _many(max_tokens=16)
    stop = threading.Event()

    def client() -> list[int]:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            return [http.post("/v1/completions", json=body).status_code for _ in range(3)]

    def health() -> list[int]:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            answers = [http.get("/health").status_code]
            while not stop.is_set():
                answers.append(http.get("/health").status_code)
            return answers

    with ThreadPoolExecutor(3) as pool:
        checks = pool.submit(health)
        loops = [pool.submit(client) for _ in range(2)]
        statuses = [status for loop in loops for status in loop.result()]
        stop.set()
        answers = checks.result()
    assert statuses == [400] * 6
    assert set(answers) == {200}
    wait_idle(server.base_url)
