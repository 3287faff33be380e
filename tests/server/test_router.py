"""``pagedkv serve --data-parallel-size 2``: two real replicas behind the real vllm-router.

One launch serves the whole module (each replica loads the built-in model once). The tests use
the real ``openai`` client against the router, read each replica's /metrics to see where
requests went, and kill a replica with SIGKILL to check what its clients and new clients get.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import msgpack
import openai
import pytest
import zmq

from pagedkv.bench.router import RouterWorkload, run_workload
from pagedkv.server.replicas import free_port
from tests.server.helpers import MODEL, scrape, wait_until
from tests.server.process import SERVE

READY = re.compile(r"vllm-router \((\w+)\) at (\S+)/v1 in front of 2 replicas: (\S+), (\S+)")


def _children(pid: int) -> dict[int, str]:
    """Live child processes of ``pid`` and their command lines, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
    return found


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Launch:
    """The one-command launch as a user runs it; stopped with Ctrl-C (SIGINT). It starts with
    SIGINT ignored, as under a non-interactive shell's ``&`` (how CI may run): Python then
    installs no KeyboardInterrupt of its own, so the Ctrl-C at teardown proves the launcher
    handles it itself."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        command = [
            sys.executable,
            "-c",
            SERVE,
            "serve",
            "--data-parallel-size",
            "2",
            "--port",
            str(free_port()),
        ]
        command += ["--num-kv-blocks", "64", "--max-model-len", "256", "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=self.log, env=env, preexec_fn=_ignore_sigint
        )

    def ready(self):
        assert self.process.poll() is None, Path(self.log.name).read_text()
        log = Path(self.log.name).read_text()
        return READY.search(log) if "replica 1: " in log else None

    def replica_pid(self, url: str) -> int:
        port = url.rsplit(":", 1)[1]
        (pid,) = [p for p, cmd in _children(self.process.pid).items() if f"--port={port}" in cmd]
        return pid


@pytest.fixture(scope="module")
def launch():
    launch = Launch()
    try:
        match = wait_until(launch.ready, 300, "two replicas and vllm-router")
        launch.policy, launch.url, *launch.replicas = match.groups()
        launch.client = openai.OpenAI(base_url=launch.url + "/v1", api_key="none", max_retries=0)
        yield launch
        children = _children(launch.process.pid)
        assert len(children) == 3, children  # two replicas and the router
    finally:
        launch.process.send_signal(signal.SIGINT)
        status = launch.process.wait(60)
    assert status == 0, Path(launch.log.name).read_text()[-3000:]
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "a child outlived Ctrl-C"


def _prompt_tokens(url: str) -> float:
    return scrape(url)["vllm:prompt_tokens_total"]


def _warm_and_route(launch, target: str, prompt: str) -> list[float]:
    """Cache ``prompt`` on replica ``target`` directly, wait for its KV events, then send two
    requests with the same prefix through the router: the prompt tokens each replica got."""
    events = zmq.Context.instance().socket(zmq.SUB)  # see ZmqKVEventPublisher
    events.setsockopt(zmq.SUBSCRIBE, b"")
    index = launch.replicas.index(target)
    events.connect(_kv_endpoint(launch, index))
    direct = openai.OpenAI(base_url=target + "/v1", api_key="none")

    def stored():
        direct.completions.create(model=MODEL, prompt=prompt + " warm", max_tokens=1)
        while events.poll(200):
            _, _, payload = events.recv_multipart()
            if any(e["type"] == "BlockStored" for e in msgpack.unpackb(payload)[1]):
                return True
        return False

    try:
        wait_until(stored, 60, "the warm prompt's BlockStored events")
    finally:
        events.close(0)
    before = [_prompt_tokens(url) for url in launch.replicas]
    for k in range(2):
        launch.client.completions.create(model=MODEL, prompt=f"{prompt} question {k}", max_tokens=1)
    return [_prompt_tokens(url) - b for url, b in zip(launch.replicas, before, strict=True)]


def _kv_endpoint(launch, index: int) -> str:
    """The replica's KV-event socket, as the launch reports it (and hands it to the router)."""
    log = Path(launch.log.name).read_text()
    return re.search(rf"replica {index}: \S+, KV events on (tcp://\S+)", log).group(1)


def test_openai_client_through_the_router(launch):
    assert launch.policy == "kv_aware"
    assert [m.id for m in launch.client.models.list().data] == [MODEL]
    completion = launch.client.completions.create(
        model=MODEL, prompt="import os", max_tokens=4, temperature=0
    )
    direct = openai.OpenAI(base_url=launch.replicas[0] + "/v1", api_key="none")
    same = direct.completions.create(model=MODEL, prompt="import os", max_tokens=4, temperature=0)
    assert completion.choices[0].text == same.choices[0].text
    chat = launch.client.chat.completions.create(  # greedy: a sampled end of text ended it early once
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True, temperature=0
    )
    chunks = list(chat)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("index", [0, 1])
def test_kv_aware_routes_to_the_replica_holding_the_prefix(launch, index):
    prefix = f"replica {index} holds this system prompt about the os module and its path helpers " * 3
    got = _warm_and_route(launch, launch.replicas[index], prefix)
    assert got[index] > 0 and got[1 - index] == 0, got


def test_a_killed_replica_fails_only_its_requests_and_rejoins_when_restarted(launch):
    client = openai.OpenAI(base_url=launch.url + "/v1", api_key="none", max_retries=0, timeout=120)
    outcomes: dict[int, object] = {}

    def stream(i: int) -> None:
        try:
            chunks = client.completions.create(
                model=MODEL, prompt=f"load {i}: " + "tell me about sockets " * (i + 1),
                max_tokens=200, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            outcomes[i] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        except (openai.APIError, httpx.HTTPError) as err:
            outcomes[i] = err

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    running = lambda url: scrape(url)["vllm:num_requests_running"]  # noqa: E731
    wait_until(lambda: all(running(url) > 0 for url in launch.replicas), 120, "load on both replicas")
    victim_pid = launch.replica_pid(launch.replicas[0])
    os.kill(victim_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(180)  # a bound on a hang, not a race: each stream ends once its replica does
    assert not any(thread.is_alive() for thread in threads), "a request hung after the kill"
    failed = [o for o in outcomes.values() if isinstance(o, Exception)]
    finished = [o for o in outcomes.values() if not isinstance(o, Exception)]
    assert len(outcomes) == 6 and finished, outcomes  # the survivor's requests complete
    assert all(reason == "length" for reason in finished), outcomes
    assert len(failed) < 6, outcomes
    # New requests while the victim is down (or restarting) go to the survivor and succeed.
    for k in range(3):
        reply = client.completions.create(model=MODEL, prompt=f"after the kill {k}", max_tokens=2)
        assert reply.choices[0].text is not None
    # The supervisor restarts the victim on its port; once healthy, the router sends to it again.
    wait_until(lambda: _healthy(launch.replicas[0]), 300, "replica 0 restarted and healthy")
    assert launch.replica_pid(launch.replicas[0]) != victim_pid
    attempts = iter(range(100))
    wait_until(
        lambda: (
            _warm_and_route(launch, launch.replicas[0], f"restarted, attempt {next(attempts)} " * 6)[0] > 0
        ),
        120,
        "the router to send a prefix cached on the restarted replica to it",
    )


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_bench_router_reads_hit_rate_and_split_off_the_replicas(launch):
    """``pagedkv bench router``'s measurement against the running pair (the full bench is a
    benchmark, not a test): every request is counted once and shared prefixes hit."""
    workload = RouterWorkload(num_systems=2, users_per_system=4, system_words=40, concurrency=2)
    run = run_workload("bench check", launch.url, launch.replicas, workload)
    assert sum(run.requests_per_replica) == 8
    assert 0 < run.hit_rate < 1 and run.ttft_median_s > 0


def test_a_replica_that_cannot_start_stops_the_launch_with_its_reason(tmp_path):
    command = [sys.executable, "-c", SERVE, "serve", "--data-parallel-size", "2", "--port", str(free_port())]
    command += ["--model", str(tmp_path / "no-such-model")]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert "no-such-model" in done.stderr and "before it was ready" in done.stderr


@pytest.mark.parametrize(
    "options, problem",
    [
        (["--router-policy", "fastest"], "unknown router policy 'fastest'"),
        (["--kv-events-config", "{}"], "give one or the other"),
    ],
)
def test_bad_replica_options_are_usage_errors(options, problem):
    command = [sys.executable, "-c", SERVE, "serve", "--data-parallel-size", "2", *options]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and problem in done.stderr
