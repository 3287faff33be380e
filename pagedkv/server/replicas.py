"""N ``pagedkv serve`` replicas behind ``vllm-router``, started and stopped together.

``pagedkv serve --data-parallel-size N`` runs this: each replica is its own process with its own
engine, HTTP port and KV-event socket (:mod:`pagedkv.server.kv_events`); the router, vLLM's
Rust ``vllm-router``, listens on the user's ``--port`` and spreads requests over them with the
chosen policy (``kv_aware`` by default: it follows the replicas' KV cache events). Nothing here
balances load: that is the router's job.

Processes: the replicas and the router are children of this supervisor and die with it (the
kernel sends them SIGTERM if it is killed outright, ``PR_SET_PDEATHSIG``). Ctrl-C or SIGTERM
stops every child and waits for it; a replica that dies is started again on the same port and
socket, and the router's health checks bring it back into rotation. A replica is handed its
settings as a pickled :class:`ReplicaSpec` on stdin (``python -m pagedkv.server.replicas``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedkv.engine import EngineConfig
from pagedkv.memory.pool_sizing import PoolSizing
from pagedkv.server.kv_events import KVEventsConfig

#: vllm-router's policies that pagedkv replicas support (all of them need nothing extra but kv_aware).
ROUTER_POLICIES = ("kv_aware", "cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")
#: Router settings for replicas on one machine: notice a dead or returning replica in seconds.
LOCAL_ROUTER_ARGS = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "1",
    "--worker-startup-check-interval", "1",
    "--cb-timeout-duration-secs", "2",
)  # fmt: skip
_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 20.0
_RESTART_INTERVAL_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's choice)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, what: str) -> None:
    """Return once ``url/health`` answers 200; an error if ``process`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} was not healthy at {url} within {timeout:.0f} s")


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: Ctrl-C and SIGTERM still stop the children through the supervisor


@dataclass(frozen=True)
class ReplicaSpec:
    """What one replica process runs: ``create_app(engine, kv_events=..., **app_options)``."""

    engine: EngineConfig
    port: int
    kv_events_port: int
    app_options: dict = field(default_factory=dict)
    log_level: str = "warning"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port}"


class ReplicaSet:
    """``with ReplicaSet(config, 2) as replicas: openai.OpenAI(base_url=replicas.url + "/v1")``."""

    def __init__(
        self,
        engine: EngineConfig,
        num_replicas: int,
        *,
        policy: str = "kv_aware",
        host: str = "127.0.0.1",
        port: int = 0,
        app_options: dict | None = None,
        router_args: tuple[str, ...] = (),
        log_level: str = "warning",
        log=None,
    ) -> None:
        """``log``: where the children's output goes (a file, ``subprocess.DEVNULL``; None: here)."""
        if num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {num_replicas}")
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose one of {', '.join(ROUTER_POLICIES)}")
        if importlib.util.find_spec("vllm_router") is None:
            raise ValueError("replicas need vllm-router, not installed here: pip install 'pagedkv[router]'")
        self.policy = policy
        self.host = host
        self.port = port or free_port()
        self.router_args = tuple(router_args)
        self.log_level = log_level
        self.log = log
        #: How each replica's pool was sized here, for all of them (None: a size was given).
        self.kv_sizing = None
        cache = engine.resolve().cache
        if cache.num_kv_blocks is None and cache.pool_bytes is None:
            engine, self.kv_sizing = split_auto_pool(engine, num_replicas)
        self.specs = [
            ReplicaSpec(engine, free_port(), free_port(), dict(app_options or {}), log_level)
            for _ in range(num_replicas)
        ]
        self.replicas: list[subprocess.Popen | None] = [None] * num_replicas
        self._started_at = [0.0] * num_replicas
        self.router: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def replica_urls(self) -> list[str]:
        return [spec.url for spec in self.specs]

    # -- processes ----------------------------------------------------------------------------
    def _spawn(self, command: list[str], stdin: bytes | None = None) -> subprocess.Popen:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=self.log, stderr=self.log, preexec_fn=die_with_parent,
        )  # fmt: skip
        if stdin is not None:
            process.stdin.write(stdin)
            process.stdin.close()
        return process

    def start_replica(self, index: int) -> None:
        """Start (or restart) replica ``index`` on its port and KV-event socket."""
        spec = self.specs[index]
        # The labels only make the process list readable; the settings come on stdin.
        command = [
            sys.executable,
            "-m",
            "pagedkv.server.replicas",
            f"--replica={index}",
            f"--port={spec.port}",
        ]
        with self._lock:
            self.replicas[index] = self._spawn(command, pickle.dumps(spec))
            self._started_at[index] = time.monotonic()

    def router_command(self) -> list[str]:
        model = self.specs[0].app_options.get("served_model_name") or "pagedkv"
        command = [sys.executable, "-m", "vllm_router.launch_router", "--host", self.host]
        command += ["--port", str(self.port), "--policy", self.policy, "--worker-urls", *self.replica_urls]
        command += ["--prometheus-port", str(free_port()), "--log-level", "warning", *LOCAL_ROUTER_ARGS]
        if self.policy == "kv_aware":
            for spec in self.specs:
                command += ["--kv-event-source", f"{spec.url}={spec.kv_events_endpoint}"]
            command += ["--kv-event-block-size", str(self.specs[0].engine.block_size)]
            command += ["--kv-event-model", model]
        if self.specs[0].app_options.get("api_key"):
            command += ["--api-key", self.specs[0].app_options["api_key"]]
        return command + list(self.router_args)

    def wait_healthy(self, url: str, process: subprocess.Popen, timeout: float, what: str) -> None:
        wait_healthy(url, process, timeout, what)

    def start(self, timeout: float = 300.0) -> ReplicaSet:
        """Start the replicas, wait until each is healthy, then the router; all or nothing."""
        try:
            for index in range(len(self.specs)):
                self.start_replica(index)
            for index, spec in enumerate(self.specs):
                self.wait_healthy(spec.url, self.replicas[index], timeout, f"replica {index}")
            self.router = self._spawn(self.router_command())
            self.wait_healthy(self.url, self.router, timeout, "vllm-router")
        except BaseException:
            self.stop()
            raise
        return self

    def supervise(self, poll_s: float = 0.5) -> int:
        """Restart replicas that die until stopped; returns the router's failure status, or 0."""
        while not self.stopping.wait(poll_s):
            if self.router is not None and self.router.poll() is not None:
                print(f"vllm-router exited with status {self.router.returncode}", file=sys.stderr)
                return self.router.returncode or 1
            for index, process in enumerate(self.replicas):
                if process is None or process.poll() is None or self.stopping.is_set():
                    continue
                # One that keeps failing as it starts is retried every few seconds, not in a spin.
                if time.monotonic() - self._started_at[index] >= _RESTART_INTERVAL_S:
                    print(f"replica {index} exited ({process.returncode}); restarting it", file=sys.stderr)
                    self.start_replica(index)
        return 0

    def restart_router(self, policy: str, timeout: float = 120.0) -> None:
        """Stop the router and start a fresh one (empty index) with ``policy``; replicas keep running."""
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose one of {', '.join(ROUTER_POLICIES)}")
        if self.router is not None:
            self.router.terminate()
            self.router.wait(_STOP_GRACE_S)
        self.policy = policy
        self.router = self._spawn(self.router_command())
        self.wait_healthy(self.url, self.router, timeout, "vllm-router")

    def stop(self) -> None:
        """SIGTERM every child (the router first), wait, then SIGKILL whatever is left."""
        self.stopping.set()
        with self._lock:
            children = [p for p in [self.router, *self.replicas] if p is not None]
        for process in children:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in children:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> ReplicaSet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def split_auto_pool(engine: EngineConfig, num_replicas: int) -> tuple[EngineConfig, PoolSizing | None]:
    """``engine`` with the block count of an "auto" pool sized once for ``num_replicas``
    replicas on this machine: they draw on the same memory, so they split it as the ranks of
    one machine do (:func:`~pagedkv.engine.worker.executor.rank.size_rank_pools`), and a replica
    restarted while the others hold theirs gets the same pool. Its blocks are those each replica
    pages by: a KV group's layers deep where the model has sliding-window layers (hybrid
    paging), every layer's otherwise. A model folder that cannot be
    read is left to the replicas, which fail with the reason (sizing None)."""
    from pagedkv.engine.worker.executor.hybrid import engine_kv_groups
    from pagedkv.engine.worker.executor.rank import size_rank_pools
    from pagedkv.models import ModelConfig, builtin_model_path

    path = Path(engine.model) if engine.model is not None else builtin_model_path()
    try:
        model_config = ModelConfig.from_pretrained(path)
    except (OSError, ValueError):
        return engine, None
    settings = engine.resolve()
    kv_groups, _ = engine_kv_groups(
        settings, model_config
    )  # a block of a group's layers, as each replica pages
    ranks = num_replicas * settings.parallel.tensor_parallel_size
    sizing = size_rank_pools(settings, model_config, path, ranks, kv_groups)
    return dataclasses.replace(engine, num_kv_blocks=sizing.num_blocks), sizing


def serve_replicas(replicas: ReplicaSet) -> int:
    """Run until Ctrl-C or SIGTERM, then stop every process (``pagedkv serve --data-parallel-size``).

    Ctrl-C is handled explicitly, as uvicorn does for one server: a process started where SIGINT
    is ignored (a background job of a non-interactive shell) inherits the ignore, and Python then
    never raises KeyboardInterrupt -- the supervisor would outlive every Ctrl-C."""
    previous_term = signal.signal(signal.SIGTERM, lambda *_: replicas.stopping.set())
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        replicas.start()
        urls = ", ".join(replicas.replica_urls)
        print(
            f"vllm-router ({replicas.policy}) at {replicas.url}/v1 in front of {len(replicas.specs)} "
            f"replicas: {urls}",
            file=sys.stderr,
        )
        for index, spec in enumerate(replicas.specs):
            print(f"replica {index}: {spec.url}, KV events on {spec.kv_events_endpoint}", file=sys.stderr)
        if replicas.kv_sizing is not None:
            print(f"{replicas.kv_sizing.describe()}, in each replica", file=sys.stderr)
        return replicas.supervise()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as err:  # a replica or the router did not come up
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        replicas.stop()
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGINT, previous_int)


def _run_replica() -> None:
    """One replica: the spec from stdin, then uvicorn until SIGTERM or SIGINT."""
    from pagedkv.server.app import create_app
    from pagedkv.server.runner import Server

    spec: ReplicaSpec = pickle.load(sys.stdin.buffer)
    kv_events = KVEventsConfig(enable_kv_cache_events=True, endpoint=spec.kv_events_endpoint)
    app = create_app(spec.engine, kv_events=kv_events, **spec.app_options)
    # Server, not uvicorn.run: an open dashboard stream must not keep the replica from stopping
    server = Server(app, host="127.0.0.1", port=spec.port, log_level=spec.log_level)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled
        server.run()


if __name__ == "__main__":
    _run_replica()
