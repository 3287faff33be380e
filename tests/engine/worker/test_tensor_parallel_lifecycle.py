"""A tensor-parallel engine's life: how its ranks start, how a start fails, how it is released.

Real scripts in their own interpreters (a script without ``if __name__ == "__main__":`` works
when the ranks fork, and fails at once naming the guard when they are spawned), real worker
processes killed while they start, and two engines one after the other in one process (released
by ``del`` + garbage collection, then by ``with``) giving the same tokens. Every wait is for a
process or an answer, with a bound far above what it takes and far below the ten minutes a rank
used to wait for a peer that had died.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

from pagedkv import LLM, SamplingParams
from pagedkv.engine import EngineConfig
from pagedkv.engine.worker.executor import ExecutorError
from pagedkv.engine.worker.executor.launch import START_METHOD_ENV
from pagedkv.server import ServerThread, create_app
from tests.checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]
OPTIONS = dict(tensor_parallel_size=2, num_kv_blocks=32, block_size=4, dtype="float32")
#: generous: a start that fails takes an interpreter and a torch import (seconds), not the
#: ten minutes of the rendezvous timeout
BOUND = 180

# A user's script as the issue found it: everything at the top level, no main guard. Two
# engines one after the other (the first dropped, the second in a with block); prints the start
# method and both engines' tokens.
NO_GUARD_SCRIPT = """
import gc, json, sys
from pagedkv import LLM, SamplingParams
options = dict(tensor_parallel_size=2, num_kv_blocks=32, block_size=4, dtype="float32")
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]
llm = LLM(sys.argv[1], **options)
method = llm.engine.executor.start_method
first = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
del llm
gc.collect()
with LLM(sys.argv[1], **options) as llm:
    second = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
print(json.dumps({"method": method, "first": first, "second": second}))
"""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp-lifecycle"), "llama")


@pytest.fixture(scope="module")
def expected(model_path) -> list[list[int]]:
    """One rank's greedy tokens: what every tensor-parallel engine below must give."""
    with LLM(str(model_path), dtype="float32") as one:
        return [out.outputs[0].token_ids for out in one.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _run_script(tmp_path: Path, script: str, *args: str, method: str | None = None):
    """Run ``script`` as a file (spawn re-imports it), with the start method forced or not."""
    path = tmp_path / "user_script.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop(START_METHOD_ENV, None)
    if method is not None:
        env[START_METHOD_ENV] = method
    started = time.monotonic()
    command = [sys.executable, str(path), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=BOUND, cwd=tmp_path)
    return done, time.monotonic() - started


def _live_children() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedkv-tp-rank")]


def test_a_script_without_main_guard_forks_its_ranks_and_runs_two_engines(tmp_path, model_path, expected):
    done, _ = _run_script(tmp_path, NO_GUARD_SCRIPT, str(model_path))
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["method"] == "fork"  # Linux, a CPU engine, no CUDA: fork is safe
    assert printed["first"] == printed["second"] == expected


def test_a_script_without_main_guard_names_the_guard_when_its_ranks_are_spawned(tmp_path, model_path):
    done, elapsed = _run_script(tmp_path, NO_GUARD_SCRIPT, str(model_path), method="spawn")
    assert done.returncode != 0
    assert "rank 1" in done.stderr and "exited with code 78" in done.stderr, done.stderr
    assert 'Put the script\'s code under `if __name__ == "__main__":`' in done.stderr
    assert "bootstrapping phase" not in done.stderr  # ours, not Python's generic error
    assert elapsed < BOUND


# What makes a fork unsafe, done before the engine starts: this thread ran OpenMP regions on two
# threads (GNU OpenMP keeps a pool per thread, whose threads a fork does not copy) and the
# process listens on a socket. The rank must compute (on two threads of its own) and must not
# keep the socket open once its owner closes it.
FORK_HAZARDS_SCRIPT = """
import json, socket, sys
import torch
from pagedkv import LLM, SamplingParams
torch.set_num_threads(2)
matrix = torch.randn(512, 512)
for _ in range(10):
    matrix @ matrix
listener = socket.create_server(("127.0.0.1", 0))
port = listener.getsockname()[1]
options = dict(tensor_parallel_size=2, threads_per_rank=2, num_kv_blocks=32, block_size=4, dtype="float32")
with LLM(sys.argv[1], **options) as llm:
    listener.close()
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        refused = False
    except ConnectionRefusedError:
        refused = True
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate([[5, 6, 7], [9, 10, 11, 12, 13, 14]], params)]
    print(json.dumps({"method": llm.engine.executor.start_method, "refused": refused, "tokens": tokens}))
"""


def test_a_forked_rank_computes_after_openmp_ran_here_and_keeps_no_socket_of_ours(
    tmp_path, model_path, expected
):
    done, _ = _run_script(tmp_path, FORK_HAZARDS_SCRIPT, str(model_path))
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    assert printed["method"] == "fork"
    assert printed["refused"]  # the listening socket closed with its owner's close
    assert printed["tokens"] == expected


def test_a_bad_start_method_is_refused(model_path, monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "threads")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV} must be fork, spawn or auto"):
        LLM(str(model_path), **OPTIONS)
    assert _live_children() == []


# The forked rank dies the moment it exists (an at-fork hook in its parent's script kills it),
# before it could join anything.
KILLED_AT_FORK_SCRIPT = """
import os, signal, sys, time
from pagedkv import LLM
from pagedkv.engine.worker.executor import ExecutorError
os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGKILL))
started = time.monotonic()
try:
    LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=32, block_size=4)
except ExecutorError as err:
    print(f"{time.monotonic() - started:.2f} s: {err}")
"""


def test_a_forked_rank_that_dies_ends_start_up_with_its_exit_status(tmp_path, model_path):
    done, elapsed = _run_script(tmp_path, KILLED_AT_FORK_SCRIPT, str(model_path), method="fork")
    assert done.returncode == 0, done.stderr
    assert "tensor-parallel rank 1 (pid" in done.stdout and "killed by SIGKILL" in done.stdout, done.stdout
    assert elapsed < BOUND


def test_a_spawned_rank_killed_while_starting_ends_start_up_with_its_exit_status(model_path, monkeypatch):
    """Killed as soon as it exists: a spawned rank is still starting its interpreter then."""
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    killed: list[float] = []

    def kill_the_rank_once_it_exists() -> None:
        deadline = time.monotonic() + BOUND
        while not (children := _live_children()) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(children[0].pid, signal.SIGKILL)
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_the_rank_once_it_exists, daemon=True)
    killer.start()
    with pytest.raises(ExecutorError, match=r"tensor-parallel rank 1 \(pid \d+\) killed by SIGKILL"):
        LLM(str(model_path), **OPTIONS)
    killer.join(BOUND)
    assert killed and time.monotonic() - killed[0] < BOUND
    assert _live_children() == []
    assert not dist.is_initialized()


def test_two_engines_in_a_row_in_one_process_give_the_same_tokens(model_path, expected):
    llm = LLM(str(model_path), **OPTIONS)
    executor = weakref.ref(llm.engine.executor)
    worker = llm.engine.executor.workers[1]
    assert _tokens(llm) == expected
    del llm
    gc.collect()
    # the finalizer released the ranks without keeping the engine alive
    assert executor() is None
    assert not dist.is_initialized()
    assert worker.exitcode == 0  # it took the goodbye: a clean stop
    with LLM(str(model_path), **OPTIONS) as llm:
        assert _tokens(llm) == expected
        workers = dict(llm.engine.executor.workers)
    assert not dist.is_initialized()
    assert all(process.exitcode == 0 for process in workers.values())
    with pytest.raises(ExecutorError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()  # idempotent
    llm.engine.shutdown()
    assert _live_children() == []


def test_shutdown_releases_at_once_and_a_third_engine_starts(model_path, expected):
    llm = LLM(str(model_path), **OPTIONS)
    llm.shutdown()  # the engine object is still referenced: its ranks and group are gone anyway
    assert not dist.is_initialized() and _live_children() == []
    with pytest.raises(ExecutorError, match="shut down"):
        llm.engine.check_health()
    with LLM(str(model_path), **OPTIONS) as again:
        assert _tokens(again) == expected


def test_two_tensor_parallel_servers_in_a_row_in_one_process_answer_alike(model_path):
    """A server that built its engine releases it (ranks and group) when its lifespan ends."""
    with LLM(str(model_path), dtype="float32") as one:
        expected = one.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].text
    texts = []
    for _ in range(2):
        app = create_app(EngineConfig(str(model_path), **OPTIONS))
        body = {"model": app.state.context.model_name, "prompt": PROMPTS[1], "max_tokens": 8}
        with ServerThread(app) as server:
            answer = httpx.post(
                f"{server.base_url}/v1/completions", json={**body, "temperature": 0, "ignore_eos": True}
            )
            assert answer.status_code == 200, answer.text
            texts.append(answer.json()["choices"][0]["text"])
        assert not dist.is_initialized() and _live_children() == []
    assert texts == [expected, expected]


@pytest.mark.parametrize(("kv_heads", "ratio"), [(2, 2), (1, 1)])
def test_kv_cache_memory_is_per_rank(tmp_path, kv_heads, ratio):
    """Each rank holds its share of the KV heads (one of two; a single head is replicated), so
    the same memory per rank holds twice the blocks, or as many."""
    path = make_checkpoint(tmp_path, "llama", num_key_value_heads=kv_heads)
    budget = "96KiB"
    with LLM(str(path), dtype="float32", kv_cache_memory=budget, block_size=4) as one:
        single = one.kv_stats()
    with LLM(str(path), dtype="float32", kv_cache_memory=budget, block_size=4, tensor_parallel_size=2) as two:
        sharded = two.kv_stats()
        described = two.engine.describe()
    assert sharded["tensor_parallel_size"] == 2 and single["tensor_parallel_size"] == 1
    assert sharded["bytes_per_token"] * ratio == single["bytes_per_token"]
    assert sharded["blocks_total"] == 96 * 1024 // (sharded["bytes_per_token"] * 4)
    assert sharded["blocks_total"] == ratio * single["blocks_total"]
    assert sharded["kv_cache_bytes"] <= 96 * 1024
    assert f"({sharded['blocks_total']} blocks)" in described and "MiB per rank" in described
