"""The worker thread on its own: it sleeps when idle, and never leaves a caller waiting forever."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedkv.engine import EngineConfig, InvalidRequestError, LLMEngine, RequestOutput, SamplingParams
from pagedkv.server.async_engine import Aborted, AsyncEngine, Stream
from pagedkv.server.errors import QueueFullError
from pagedkv.server.metrics import ServerMetrics
from tests.server.helpers import EngineGate

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
    return time.clock_gettime(time.pthread_getcpuclockid(async_engine.thread.ident))


def test_an_idle_worker_sleeps(worker):
    time.sleep(0.1)
    before = _cpu_seconds(worker)
    time.sleep(0.5)
    assert _cpu_seconds(worker) - before < 0.02  # a busy loop would burn ~0.5 s


def test_outputs_stream_in_and_the_request_finishes(worker, engine):
    async def run() -> list[RequestOutput]:
        stream = Stream()
        await worker.add(["r"], [engine.tokenizer.encode("hi")], SamplingParams(max_tokens=5), stream)
        outputs = []
        while not outputs or not outputs[-1].finished:
            tag, output = await stream.get()
            assert tag == 0
            outputs.append(output)
        return outputs

    outputs = asyncio.run(run())
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, len(outputs) + 1))
    assert outputs[-1].outputs[0].finish_reason in ("stop", "length")


def test_shutdown_aborts_running_requests_and_refuses_new_ones(worker, engine):
    async def run():
        stream = Stream()
        gate.open_until(lambda outputs: bool(outputs))  # held after the first token: still running
        await worker.add(["long"], [engine.tokenizer.encode("go on")], LONG, stream)
        _, first = await stream.get()
        assert isinstance(first, RequestOutput) and not first.finished
        await asyncio.to_thread(worker.shutdown)
        while isinstance(item := (await stream.get())[1], RequestOutput):
            pass
        assert isinstance(item, Aborted)
        with pytest.raises(Aborted, match="shutting down"):
            await worker.add(["late"], [[5, 6]], LONG, Stream())

    with EngineGate(engine) as gate:
        asyncio.run(run())
    assert not worker.is_alive
    assert worker.stats["blocks_used"] == 0


def test_a_crashed_worker_fails_its_callers_instead_of_hanging(worker, engine, monkeypatch):
    async def run():
        stream = Stream()
        await worker.add(["victim"], [[5, 6, 7]], LONG, stream)
        monkeypatch.setattr(engine, "stats", lambda: 1 / 0)  # outside step(): kills the loop
        while isinstance(item := (await stream.get())[1], RequestOutput):
            pass
        assert isinstance(item, Aborted) and "crashed" in str(item)
        with pytest.raises(Aborted, match="crashed"):
            await worker.add(["next"], [[5, 6]], LONG, Stream())

    asyncio.run(run())
    monkeypatch.undo()
    worker.thread.join(5)
    assert not worker.is_alive


def test_a_full_waiting_queue_refuses_at_once(engine):
    async_engine = AsyncEngine(engine, ServerMetrics("test"), max_waiting=0)

    async def run():
        with pytest.raises(QueueFullError):
            await async_engine.add(["r"], [[5, 6]], LONG, Stream())

    try:
        asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert not engine.requests


def test_the_prompts_of_a_request_are_admitted_together_and_counted_by_prompt(engine):
    """Three prompts against room for two: all refused at once; two prompts: admitted in one turn."""
    async_engine = AsyncEngine(engine, ServerMetrics("test"), max_waiting=2)

    async def run():
        with pytest.raises(QueueFullError, match="brings 3 prompts"):
            await async_engine.add(["a", "b", "c"], [[5, 6]] * 3, LONG, Stream())
        assert not engine.requests
        stream = Stream()
        await async_engine.add(["a", "b"], [[5, 6], [7, 8]], LONG, stream)
        tags = {(await stream.get())[0] for _ in range(2)}  # both produce a first token
        async_engine.abort(["a", "b"])
        return tags

    try:
        assert asyncio.run(run()) == {0, 1}
    finally:
        async_engine.shutdown()
    assert not engine.requests and engine.kv_manager.num_seqs == 0


def test_one_invalid_prompt_refuses_the_whole_request(worker, engine):
    async def run():
        with pytest.raises(InvalidRequestError, match="prompt 1: .*vocabulary") as info:
            await worker.add(["ok", "bad"], [[5, 6], [5, 10**6]], LONG, Stream())
        return info.value.param

    assert asyncio.run(run()) == "prompt"
    assert not engine.requests and engine.kv_manager.num_seqs == 0


class _BrokenObserver:
    """An observer with a bug: every call raises."""

    def __init__(self) -> None:
        self.calls = 0

    def observe(self, engine: LLMEngine) -> None:
        self.calls += 1
        raise RuntimeError("a bug in a view of the engine")

    def due_in(self) -> float | None:
        return None


def test_a_failing_observer_is_detached_and_requests_go_on(worker, engine):
    broken = _BrokenObserver()
    worker.observers.append(broken)

    async def run() -> RequestOutput:
        stream = Stream()
        await worker.add(["o"], [engine.tokenizer.encode("hi")], SamplingParams(max_tokens=5), stream)
        while True:
            _, output = await stream.get()
            assert isinstance(output, RequestOutput)
            if output.finished:
                return output

    assert asyncio.run(run()).outputs[0].finish_reason in ("stop", "length")
    assert broken.calls == 1 and broken not in worker.observers and worker.is_alive
