"""The worker thread on its own: it sleeps when idle, and never leaves a caller waiting forever."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from pagedkv.server.async_engine import Aborted, AsyncEngine, Stream
from pagedkv.server.errors import QueueFullError
from pagedkv.server.metrics import ServerMetrics

LONG = SamplingParams(max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=128))


@pytest.fixture
def worker(engine):
    async_engine = AsyncEngine(engine, ServerMetrics("test"))
    yield async_engine
    async_engine.shutdown()
    assert not engine.requests and engine.kv_manager.num_seqs == 0


def _cpu_seconds(async_engine: AsyncEngine) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(async_engine._thread.ident))


def test_an_idle_worker_sleeps(worker):
    time.sleep(0.1)
    before = _cpu_seconds(worker)
    time.sleep(0.5)
    assert _cpu_seconds(worker) - before < 0.02  # a busy loop would burn ~0.5 s


def test_outputs_stream_in_and_the_request_finishes(worker, engine):
    async def run() -> list[RequestOutput]:
        stream = Stream()
        await worker.add("r", engine.tokenizer.encode("hi"), SamplingParams(max_tokens=5), stream, "tag")
        outputs = []
        while not outputs or not outputs[-1].finished:
            tag, output = await stream.get()
            assert tag == "tag"
            outputs.append(output)
        return outputs

    outputs = asyncio.run(run())
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, len(outputs) + 1))
    assert outputs[-1].outputs[0].finish_reason in ("stop", "length")


def test_shutdown_aborts_running_requests_and_refuses_new_ones(worker, engine):
    async def run():
        stream = Stream()
        await worker.add("long", engine.tokenizer.encode("go on"), LONG, stream, 0)
        _, first = await stream.get()
        assert isinstance(first, RequestOutput)
        await asyncio.to_thread(worker.shutdown)
        while isinstance(item := (await stream.get())[1], RequestOutput):
            pass
        assert isinstance(item, Aborted)
        with pytest.raises(Aborted, match="shutting down"):
            await worker.add("late", [5, 6], LONG, Stream(), 0)

    asyncio.run(run())
    assert not worker.is_alive
    assert worker.stats["blocks_used"] == 0


def test_a_crashed_worker_fails_its_callers_instead_of_hanging(worker, engine, monkeypatch):
    async def run():
        stream = Stream()
        await worker.add("victim", [5, 6, 7], LONG, stream, 0)
        monkeypatch.setattr(engine, "stats", lambda: 1 / 0)  # outside step(): kills the loop
        while isinstance(item := (await stream.get())[1], RequestOutput):
            pass
        assert isinstance(item, Aborted) and "crashed" in str(item)
        with pytest.raises(Aborted, match="crashed"):
            await worker.add("next", [5, 6], LONG, Stream(), 0)

    asyncio.run(run())
    monkeypatch.undo()
    worker._thread.join(5)
    assert not worker.is_alive


def test_a_full_waiting_queue_refuses_at_once(engine):
    async_engine = AsyncEngine(engine, ServerMetrics("test"), max_waiting=0)

    async def run():
        with pytest.raises(QueueFullError):
            await async_engine.add("r", [5, 6], LONG, Stream(), 0)

    try:
        asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert not engine.requests
