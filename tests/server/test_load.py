"""64 concurrent streaming clients through one engine: all complete, all exact, nothing leaks."""

from __future__ import annotations

import asyncio
import threading

import openai

from pagedkv import SamplingParams
from tests.server.helpers import API_KEY, MODEL, assert_pool_whole, prompts, scrape, wait_idle

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
    seen_running, done = [0], threading.Event()

    def watch() -> None:  # the batch sizes the engine ran, as /metrics showed them
        while not done.is_set():
            seen_running[0] = max(seen_running[0], scrape(base_url)["vllm:num_requests_running"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(_run_clients(base_url, batch))
    finally:
        done.set()
        watcher.join()
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
    # Continuous batching across HTTP clients: many requests shared each step.
    assert seen_running[0] >= 8
    generated = sum(len(out.outputs[0].token_ids) for out in expected)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == generated
    assert after["pagedkv:kv_cache_usage_peak_perc"] > 0
    ttft = after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"]
    assert ttft == NUM_CLIENTS
