"""One request must never take the server down: batches cancelled as a whole, a request that
fails inside the engine fails alone, errors that say nothing of the server's internals, and an
OpenAPI document that matches what the server sends.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedkv import SamplingParams
from pagedkv.engine.sample import sampler as sampler_module
from pagedkv.server import prompts as prompts_module
from tests.server.helpers import API_KEY, MODEL, EngineGate, assert_pool_whole, scrape, wait_idle, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ABORTS = "vllm:request_success_total{finished_reason=abort}"
PROMPTS = 100  # more than the 32 the batch holds: most of them stay queued


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_a_batch_whose_client_leaves_is_cancelled_queued_prompts_included(base_url, engine, stream):
    """The engine is held after one step: 32 prompts run, 68 wait, and the client leaves."""
    body = {
        "model": MODEL,
        "prompt": ["b"] * PROMPTS,
        "max_tokens": 64,  # within the request budget: the 8,192 tokens the pool holds
        "ignore_eos": True,
        "stream": stream,
    }
    before = scrape(base_url)

    async def leave():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            request = client.build_request("POST", "/v1/completions", json=body, headers=AUTH)
            sending = asyncio.ensure_future(client.send(request, stream=True))
            await asyncio.to_thread(
                wait_until, lambda: scrape(base_url)["vllm:num_requests_waiting"] == PROMPTS, 30, "one unit"
            )
            gate.open_until(lambda outputs: True)
            await asyncio.to_thread(gate.holding.wait, 30)
            metrics = scrape(base_url)
            assert (metrics["vllm:num_requests_running"], metrics["vllm:num_requests_waiting"]) == (32, 68)
            if stream:  # its headers came on admission; it leaves before reading a byte
                response = await sending
                assert response.status_code == 200
                await response.aclose()
            else:  # still waiting for its answer
                sending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await sending

    with EngineGate(engine) as gate:
        gate.close()
        asyncio.run(leave())
        after = wait_idle(base_url)
    assert_pool_whole(engine)
    assert after[ABORTS] - before[ABORTS] == PROMPTS
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 32


def _fail_sampling_for_seed(monkeypatch, seed: int) -> None:
    """Fault injection: the sampler's penalties step raises for the rows of one seed."""
    real = sampler_module.apply_penalties

    def failing(logits, params, *rest):
        if any(p.seed == seed for p in params):
            raise RuntimeError("injected sampling fault")
        return real(logits, params, *rest)

    monkeypatch.setattr(sampler_module, "apply_penalties", failing)


def test_a_request_failing_inside_the_engine_fails_alone(base_url, engine, reference, monkeypatch):
    _fail_sampling_for_seed(monkeypatch, 666)
    bystanders = [f"bystander {i} keeps going" for i in range(4)]
    body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "temperature": 0.8}

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=60, headers=AUTH) as client:

            def post(**extra):
                return client.post("/v1/completions", json={**body, **extra})

            requests = asyncio.gather(
                post(prompt="victim", seed=666),
                post(prompt="victim streams", seed=666, stream=True),
                *(post(prompt=p, seed=i) for i, p in enumerate(bystanders)),
            )
            await asyncio.to_thread(
                wait_until, lambda: scrape(base_url)["vllm:num_requests_waiting"] == 6, 30, "one batch"
            )
            gate.open_until(lambda outputs: False)
            return await requests

    with EngineGate(engine) as gate:
        gate.close()
        plain, streamed, *others = asyncio.run(run())
    assert plain.status_code == 500
    error = plain.json()["error"]
    assert "request id cmpl-" in error["message"] and "injected" not in error["message"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert streamed.status_code == 200
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "error"
    assert json.loads(events[-2][6:])["error"]["code"] == "internal_error"
    assert events[-1] == "data: [DONE]"
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=i) for i in range(4)]
    expected = reference.generate(bystanders, params, use_tqdm=False)
    assert [r.json()["choices"][0]["text"] for r in others] == [o.outputs[0].text for o in expected]
    metrics = wait_idle(base_url)
    assert metrics["vllm:request_success_total{finished_reason=error}"] >= 2
    assert_pool_whole(engine)


def test_an_unexpected_error_answers_a_plain_message_with_an_id(base_url, monkeypatch):
    def broken(*_):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(prompts_module, "check_context", broken)  # on the tokenizer thread
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    response = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert "request id cmpl-" in message and "secret" not in message and "RuntimeError" not in message


def test_openapi_documents_what_the_server_sends(base_url):
    schema = httpx.get(f"{base_url}/openapi.json").json()
    text = httpx.get(f"{base_url}/openapi.json").text
    assert '"422"' not in text and "HTTPValidationError" not in text
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "413", "500", "503"} <= set(completions)
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert {"application/json", "text/event-stream"} <= set(completions["200"]["content"])
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert all(kind.startswith("text/plain") for kind in metrics)
