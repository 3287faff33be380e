"""64 concurrent streaming clients through one engine: all complete, all exact, nothing leaks."""

from __future__ import annotations

import asyncio

import openai

from pagedkv import SamplingParams
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

NUM_CLIENTS = 64
MAX_TOKENS = 16


async def _stream(client: openai.AsyncOpenAI, prompt: str, seed: int) -> tuple[str, str, int]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, tokens = "", None, -1
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, finish, tokens


async def _run_clients(base_url: str, batch: list[str]) -> list[tuple[str, str, int]]:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        return await asyncio.gather(*(_stream(client, p, 100 + i) for i, p in enumerate(batch)))


def test_64_streaming_clients_equal_llm_generate(base_url, engine, reference):
    batch = prompts(NUM_CLIENTS, seed=64)
    before = scrape(base_url)
    slots = ENGINE_OPTIONS["max_num_seqs"]

    async def run():
        clients = asyncio.ensure_future(_run_clients(base_url, batch))
        # Every client is queued before the first step (the engine is held), so the first step
        # takes a full batch whatever the speed of the model or of the clients.
        await asyncio.to_thread(
            wait_until, lambda: scrape(base_url)["vllm:num_requests_waiting"] == NUM_CLIENTS, 30, "all queued"
        )
        gate.open_until(lambda outputs: True)
        await asyncio.to_thread(gate.holding.wait, 30)
        first_step = scrape(base_url)
        gate.open_until(lambda outputs: False)
        return await clients, first_step

    with EngineGate(engine) as gate:
        gate.close()
        results, first_step = asyncio.run(run())
    # Continuous batching across HTTP clients: one step served as many as the batch holds.
    assert first_step["vllm:num_requests_running"] == slots
    assert first_step["vllm:num_requests_waiting"] == NUM_CLIENTS - slots
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=100 + i) for i in range(NUM_CLIENTS)
    ]
    expected = reference.generate(batch, params, use_tqdm=False)
    for (text, finish, tokens), out in zip(results, expected, strict=True):
        assert text == out.outputs[0].text
        assert finish == out.outputs[0].finish_reason
        assert tokens == len(out.outputs[0].token_ids)
    after = wait_idle(base_url)
    assert_pool_whole(engine)
    generated = sum(len(out.outputs[0].token_ids) for out in expected)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == generated
    assert after["pagedkv:kv_cache_usage_peak_perc"] > 0
    ttft = after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"]
    assert ttft == NUM_CLIENTS
