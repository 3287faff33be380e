"""A tensor-parallel engine whose worker dies or hangs, or whose rank 0 fails its part of a
step, fails naming the rank, and leaves nothing.

Real processes and real signals: SIGKILL a worker, SIGSTOP one (a hang), SIGKILL the engine
itself, Ctrl-C a server; rank 0's embedding rows replaced by an empty matrix under a live server.
No test waits on the model's speed: a hang is detected by the collective timeout, and every wait
below is for a process or an answer, with a generous bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.engine.worker.executor import ExecutorError
from pagedkv.server import ServerThread, create_app
from tests.checkpoints import make_checkpoint
from tests.server.helpers import EngineGate, wait_until
from tests.server.process import ServeProcess

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp-faults"), "llama")


def _children(pid: int) -> list[int]:
    """Live worker ranks of ``pid`` (forked or spawned children; multiprocessing's resource
    tracker is not one: it leaves with its parent), read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in command:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_a_killed_worker_fails_the_engine_naming_its_rank(model_path):
    llm = LLM(str(model_path), tensor_parallel_size=2, num_kv_blocks=32, block_size=4)
    worker = llm.engine.executor.workers[1]
    assert llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(30)
    with pytest.raises(ExecutorError, match=r"rank 1 \(pid \d+\) killed by SIGKILL"):
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
    with pytest.raises(ExecutorError, match="rank 1"):
        llm.engine.check_health()
    assert llm.kv_stats()["blocks_used"] == 0  # the failed request's blocks came back
    llm.engine.shutdown()
    assert _children(os.getpid()) == []


def test_a_hung_worker_fails_the_step_within_the_collective_timeout(model_path):
    llm = LLM(str(model_path), tensor_parallel_size=2, num_kv_blocks=32, block_size=4, distributed_timeout=3)
    worker = llm.engine.executor.workers[1]
    os.kill(worker.pid, signal.SIGSTOP)  # alive, holds its sockets, answers nothing
    try:
        with pytest.raises(ExecutorError, match=r"rank 1 \(pid \d+\) stopped answering"):
            llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
        with pytest.raises(ExecutorError, match="rank 1"):
            llm.engine.check_health()
    finally:
        llm.engine.shutdown()  # kills the stopped worker
    assert _gone(worker.pid)


DRIVER = """
import sys, time
from pagedkv import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=32, block_size=4)
print(llm.engine.executor.workers[1].pid, flush=True)
time.sleep(600)
"""


def test_workers_end_when_the_engine_is_killed(model_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    engine = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(model_path)], stdout=subprocess.PIPE, env=env
    )
    worker_pid = int(engine.stdout.readline())
    engine.kill()  # no shutdown, no atexit: the worker must notice on its own
    engine.wait(30)
    wait_until(lambda: _gone(worker_pid), 60, "the orphaned worker to exit")


def test_a_server_whose_worker_dies_answers_503_and_ctrl_c_stops_every_rank(model_path):
    with ServeProcess(
        "--model", str(model_path), "--tensor-parallel-size", "2", "--num-kv-blocks", "32"
    ) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        first = client.completions.create(
            model=model_path.name, prompt="def f():", max_tokens=3, temperature=0
        )
        assert first.choices[0].text is not None
        (worker_pid,) = _children(server.process.pid)
        os.kill(worker_pid, signal.SIGKILL)
        health = wait_until(
            lambda: (r := httpx.get(f"{server.base_url}/health")).status_code == 503 and r,
            60,
            "/health to turn unhealthy",
        )
        assert "rank 1" in health.text and "SIGKILL" in health.text
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model=model_path.name, prompt="def g():", max_tokens=3, temperature=0)
        assert failed.value.status_code == 503
        server_pid = server.process.pid
    assert server.returncode == 0, server.stderr
    assert _children(server_pid) == []


def test_ctrl_c_stops_a_healthy_server_and_its_ranks(model_path):
    with ServeProcess(
        "--model", str(model_path), "--tensor-parallel-size", "2", "--num-kv-blocks", "32"
    ) as server:
        (worker_pid,) = _children(server.process.pid)
        started = time.monotonic()
    assert server.returncode == 0, server.stderr
    wait_until(lambda: _gone(worker_pid), 30, "the worker rank to exit with the server")
    assert time.monotonic() - started < 60


def _break_rank_0(engine: LLMEngine) -> None:
    """A real fault in rank 0's part of the next forward pass: its embedding rows are gone (the
    worker's are intact), so rank 0's lookup raises while rank 1 computes on."""
    embedding = engine.executor.runner.model.model.embed_tokens
    embedding.weight = torch.nn.Parameter(torch.empty(0, embedding.hidden_size))


def test_a_rank_0_failure_answers_503_and_the_server_stays_up(model_path):
    engine = LLMEngine(EngineConfig(str(model_path), tensor_parallel_size=2, num_kv_blocks=32, block_size=4))
    workers = dict(engine.executor.workers)
    app = create_app(engine)
    name = app.state.context.model_name
    body = {"model": name, "prompt": "def f():", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    try:
        with ServerThread(app) as server, EngineGate(engine) as gate:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)

            def complete():
                return client.completions.create(model=name, prompt="def g():", max_tokens=2, temperature=0)

            assert complete().choices[0].text is not None
            gate.open_until(bool)  # a streaming request's first step, then the engine is held
            url = f"{server.base_url}/v1/completions"
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))  # in flight
                assert gate.holding.wait(120)
                _break_rank_0(engine)
                gate.open_until(lambda outputs: False)
                rest = list(lines)
            errors = [json.loads(line[6:])["error"] for line in rest if line.startswith('data: {"error"')]
            assert [error["code"] for error in errors] == ["aborted"] and "data: [DONE]" in rest
            health = httpx.get(f"{server.base_url}/health")
            assert health.status_code == 503
            assert "tensor-parallel rank 0 failed while running a step: RuntimeError" in health.text
            with pytest.raises(openai.APIStatusError) as refused:
                complete()
            assert refused.value.status_code == 503 and "rank 0" in refused.value.message
            assert httpx.get(f"{server.base_url}/v1/models").status_code == 200  # still serving
            # the ranks are out of step: the worker was stopped with the step, not left to time out
            assert all(process.exitcode is not None for process in workers.values())
    finally:
        engine.shutdown()
    assert engine.kv_stats()["blocks_used"] == 0  # the aborted request's blocks came back
    assert _children(os.getpid()) == []
