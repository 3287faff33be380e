"""Faults: clients that vanish mid-stream or while queued, a tiny cache that forces preemption,
malformed requests among valid ones. The server keeps serving the others exactly, every block
returns to the pool, and /health stays green.

Where a request must still be running when its client leaves, an :class:`EngineGate` holds the
engine: the test waits on events (a first token, a metric), never on how fast the model is.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from pagedkv import SamplingParams
from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.server.helpers import (
    API_KEY,
    ENGINE_OPTIONS,
    MODEL,
    EngineGate,
    assert_pool_whole,
    prompts,
    scrape,
    wait_idle,
    wait_until,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ABORTS = "vllm:request_success_total{finished_reason=abort}"
LONG = 200  # max_tokens of requests meant to be cut short: they would take many seconds


def _body(prompt: str, max_tokens: int = LONG, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def _stream_text(client: httpx.AsyncClient, body: dict) -> str:
    text = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    return text


async def _read_then_leave(client: httpx.AsyncClient, body: dict, events: int) -> int:
    """Read ``events`` SSE events, then drop the connection; returns how many were read."""
    seen = 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if seen >= events:
                break
            seen += line.startswith("data: ")
    return seen


def _admitted(base_url: str, before: dict[str, float], count: int) -> bool:
    """``count`` requests were admitted since ``before``: they wait (the engine is held) or left."""
    m = scrape(base_url)
    return m["vllm:num_requests_waiting"] + m[ABORTS] - before[ABORTS] == count


def test_clients_disconnecting_mid_stream_are_aborted_and_others_finish(base_url, engine, reference):
    rng = random.Random(0)
    leaving = [(_body(p), rng.randint(0, 6)) for p in prompts(12, seed=21)]
    staying = prompts(6, seed=22)
    before = scrape(base_url)

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            clients = asyncio.gather(
                *(_read_then_leave(client, body, events) for body, events in leaving),
                *(_stream_text(client, _body(p, max_tokens=10, seed=i)) for i, p in enumerate(staying)),
            )
            await asyncio.to_thread(wait_until, lambda: _admitted(base_url, before, 18), 30, "18 admitted")
            # One batch from here on; no leaving request can reach its LONG tokens before its
            # client (which reads at most 6 events) has left.
            gate.open_until(lambda outputs: any(len(o.outputs[0].token_ids) >= LONG // 2 for o in outputs))
            return await clients

    with EngineGate(engine) as gate:
        gate.close()
        results = asyncio.run(run())
        after = wait_idle(base_url, timeout=15)
    expected = reference.generate(
        staying, [SamplingParams(max_tokens=10, seed=i, ignore_eos=True) for i in range(6)], use_tqdm=False
    )
    assert results[12:] == [out.outputs[0].text for out in expected]
    assert_pool_whole(engine)
    assert after[ABORTS] - before[ABORTS] == 12
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated <= 12 * LONG // 2 + 6 * 10  # aborted early, not run to max_tokens


def test_requests_aborted_while_queued_leave_the_queue_at_once(base_url, engine):
    slots = ENGINE_OPTIONS["max_num_seqs"]
    before = scrape(base_url)

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:

            async def open_stream(prompt):
                stream = client.stream(
                    "POST", "/v1/completions", json=_body(prompt, stream=True), headers=AUTH
                )
                response = await stream.__aenter__()
                assert response.status_code == 200  # sent once admitted
                return stream

            running = [await open_stream(p) for p in prompts(slots, seed=31)]
            gate.open_until(lambda outputs: len(outputs) == slots)  # one step: the batch is full
            await asyncio.to_thread(gate.holding.wait, 30)
            queued = [await open_stream(p) for p in prompts(8, seed=32)]
            await asyncio.to_thread(
                wait_until, lambda: scrape(base_url)["vllm:num_requests_waiting"] == 8, 20, "8 queued"
            )
            for stream in queued:
                await stream.__aexit__(None, None, None)

            def queue_empty_batch_full():
                m = scrape(base_url)
                return m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == slots

            await asyncio.to_thread(
                wait_until, queue_empty_batch_full, 5, "the queued requests to be aborted"
            )
            for stream in running:
                await stream.__aexit__(None, None, None)

    with EngineGate(engine) as gate:
        gate.close()
        asyncio.run(run())
        after = wait_idle(base_url, timeout=15)
    assert_pool_whole(engine)
    assert after[ABORTS] - before[ABORTS] == slots + 8
    # Only the running requests ever produced a token: the queued ones left from the queue.
    ttft = "vllm:time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] == slots


def test_non_streaming_client_that_gives_up_is_aborted(base_url, engine):
    """The engine is held after the request's first token: only the client's leaving can end it."""
    before = scrape(base_url)

    async def give_up():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            post = asyncio.ensure_future(
                client.post("/v1/completions", json=_body("wait for me"), headers=AUTH)
            )
            await asyncio.to_thread(gate.holding.wait, 30)
            post.cancel()  # the client gives up: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await post

    with EngineGate(engine) as gate:
        gate.open_until(lambda outputs: bool(outputs))
        asyncio.run(give_up())
        after = wait_idle(base_url, timeout=10)
    assert_pool_whole(engine)
    assert after[ABORTS] - before[ABORTS] == 1
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 1


def test_malformed_requests_among_valid_ones(base_url, engine, reference):
    valid = prompts(10, seed=41)
    bad = [
        b"{not json",
        b'{"model": "pagedkv-builtin", "prompt": "x", "temperature": -1}',
        b'{"model": "pagedkv-builtin", "prompt": "x", "max_tokens": 1000}',
        b'{"model": "gpt-4", "prompt": "x"}',
        # The reproductions: each used to take the engine step (and these streams) down.
        b'{"prompt": "hi", "max_tokens": 5, "min_tokens": 1, "stop_token_ids": [2048]}',
        b'{"prompt": "hello", "n": 1000000, "max_tokens": 3}',
        b'{"prompt": "a\\ud800b", "max_tokens": 3}',
    ]

    async def run():
        async with (
            openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as client,
            httpx.AsyncClient(base_url=base_url, timeout=60) as raw,
        ):

            async def good(i, prompt):
                stream = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=10, seed=i, stream=True
                )
                return "".join([c.choices[0].text async for c in stream])

            async def malformed(content):
                headers = {**AUTH, "Content-Type": "application/json"}
                return (await raw.post("/v1/completions", content=content, headers=headers)).status_code

            async def health():
                return (await raw.get("/health")).status_code

            return await asyncio.gather(
                *(good(i, p) for i, p in enumerate(valid)), *(malformed(b) for b in bad), health()
            )

    results = asyncio.run(run())
    expected = reference.generate(
        valid, [SamplingParams(max_tokens=10, seed=i) for i in range(10)], use_tqdm=False
    )
    assert results[:10] == [out.outputs[0].text for out in expected]
    assert results[10:] == [400] * len(bad) + [200]
    wait_idle(base_url)
    assert_pool_whole(engine)


@pytest.fixture(scope="module")
def small_cache_server():
    """20 blocks of 16 tokens: 12 requests of 52 tokens (4 blocks each) cannot all fit. Without
    decode headroom admission over-commits on purpose, so running requests get preempted."""
    options = {**ENGINE_OPTIONS, "num_kv_blocks": 20, "max_num_seqs": 16, "decode_headroom": 0.0}
    config = EngineConfig(**options)
    with ServerThread(create_app(config)) as server:
        yield server


def test_preemption_under_a_small_cache_keeps_outputs_exact(small_cache_server, reference):
    base_url = small_cache_server.base_url
    batch = prompts(12, seed=51)

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(
                *(_stream_text(client, _body(p, max_tokens=40, seed=i)) for i, p in enumerate(batch))
            )

    results = asyncio.run(run())
    params = [SamplingParams(max_tokens=40, seed=i, ignore_eos=True) for i in range(12)]
    expected = reference.generate(batch, params, use_tqdm=False)
    assert results == [out.outputs[0].text for out in expected]
    metrics = wait_idle(base_url)
    assert metrics["vllm:num_preemptions_total"] > 0
    assert metrics["pagedkv:kv_cache_usage_peak_perc"] > 0.8
    assert_pool_whole(small_cache_server.app.state.engine.engine)


def test_an_engine_failure_fails_its_requests_but_not_the_server(small_cache_server):
    """A step that raises (a bug) ends the requests in flight with an error; the next ones work."""
    base_url = small_cache_server.base_url
    engine = small_cache_server.app.state.engine.engine
    real_step = engine.step

    def failing_step():
        engine.step = real_step  # fail once
        raise RuntimeError("injected fault")

    engine.step = failing_step
    whole = httpx.post(f"{base_url}/v1/completions", json=_body("fail me", max_tokens=4), timeout=30)
    assert whole.status_code == 503
    message = whole.json()["error"]["message"]
    assert "the engine failed" in message and "request id cmpl-" in message
    assert "injected fault" not in message  # the exception is in the log, not in the answer
    wait_idle(base_url)
    assert_pool_whole(engine)
    again = httpx.post(f"{base_url}/v1/completions", json=_body("fine now", max_tokens=4), timeout=30)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


def _sse_events(response: httpx.Response) -> list[dict | str]:
    return [
        line[6:] if line == "data: [DONE]" else httpx.Response(200, content=line[6:]).json()
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]


def test_a_stream_the_engine_aborts_still_ends_every_choice(small_cache_server):
    """A failing step aborts the streams in flight: each choice gets its finish_reason first."""
    base_url = small_cache_server.base_url
    engine = small_cache_server.app.state.engine.engine
    real_step = engine.step

    def failing_step():
        engine.step = real_step
        raise RuntimeError("injected fault")

    engine.step = failing_step
    body = _body("fail my stream", max_tokens=4, n=2, stream=True)
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200  # the stream had started
    *chunks, error, done = _sse_events(response)
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]
    assert {c["choices"][0]["finish_reason"] for c in chunks} == {"abort"}
    assert error["error"]["code"] == "aborted" and "request id cmpl-" in error["error"]["message"]
    assert done == "[DONE]"
    wait_idle(base_url)
    assert_pool_whole(engine)
