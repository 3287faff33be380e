"""``pagedkv bench router``: prefix-cache hit rate and TTFT of 2 replicas under vllm-router's policies.

The workload is the one KV-aware routing exists for: a few long system prompts, each shared by
many users, sent in a shuffled order by a fixed number of concurrent clients. Each replica's KV
cache holds about half of the system prompts, so where a prompt is sent decides whether its
prefix is still cached there. The same workload runs against

* one replica with the KV cache of both (the ceiling: every prefix competes for one cache),
* two replicas behind ``vllm-router`` under ``round_robin``, ``cache_aware`` and ``kv_aware``.

The hit rate is the replicas' own: the increase of ``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries`` (prompt tokens) in their /metrics. TTFT is measured at the client
(streaming, time to the first chunk). The pair of replicas stays up across policies; only the
router restarts, and each policy's run puts a different tag in front of every system prompt, so
no run reuses what an earlier one cached.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import httpx
from rich.console import Console

from pagedkv.bench.driver import progress, table
from pagedkv.bench.options import check_options, option
from pagedkv.bench.serve import metric_values
from pagedkv.engine import EngineConfig

POLICIES = ("round_robin", "cache_aware", "kv_aware")
#: Each replica's pool and context: a pool that holds about half of the default system prompts.
REPLICA_ENGINE = {"num_kv_blocks": 48, "max_model_len": 256}
_WORDS = (
    "module function class socket thread process buffer stream parser encoder archive path file "
    "signal queue lock event timer cache index table record field value token block string"
).split()


@dataclass(frozen=True)
class RouterWorkload:
    """``num_systems`` system prompts x ``users_per_system`` users, shuffled, ``concurrency`` clients."""

    num_systems: int = option(8, "system prompts", positive=True)
    users_per_system: int = option(32, "users of each system prompt", positive=True)
    system_words: int = option(90, "words of a system prompt (~128 tokens)", positive=True)
    user_words: int = option(8, "words of a user's question", positive=True)
    output_len: int = option(4, "tokens per request", positive=True)
    concurrency: int = option(4, "clients in flight", positive=True)
    seed: int = option(0, "workload seed")

    def __post_init__(self) -> None:
        check_options(self)

    def requests(self, tag: str) -> list[str]:
        """Every prompt, shuffled: system prompt ``i`` (after ``tag``) plus one user's question."""
        rng = random.Random(self.seed)
        words = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))  # noqa: E731
        systems = [words(self.system_words) for _ in range(self.num_systems)]
        prompts = [
            f"{tag} system {i}: {system}\nuser {u}: {words(self.user_words)}"
            for i, system in enumerate(systems)
            for u in range(self.users_per_system)
        ]
        rng.shuffle(prompts)
        return prompts


@dataclass(frozen=True)
class RouterConfig(RouterWorkload):
    """The workload, and the engine of each of the two replicas (the single one has twice its KV)."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(**REPLICA_ENGINE))


@dataclass(frozen=True)
class RouterRun:
    name: str
    hit_rate: float
    ttft_median_s: float
    ttft_p90_s: float
    requests_per_replica: tuple[int, ...]
    seconds: float


@dataclass
class RouterResult:
    config: RouterConfig
    runs: list[RouterRun]

    @property
    def ok(self) -> bool:
        """Every setup served every request."""
        expected = self.config.num_systems * self.config.users_per_system
        return all(sum(run.requests_per_replica) == expected for run in self.runs)

    def to_json(self) -> dict:
        return {"config": asdict(self.config), "runs": [asdict(run) for run in self.runs]}


def _counters(url: str) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")
    return metric_values(httpx.get(url + "/metrics", timeout=30).text, wanted)


def _ttft(client: httpx.Client, url: str, prompt: str, output_len: int) -> float:
    start = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": output_len, "stream": True, "temperature": 0}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first if first is not None else float("nan")


def run_workload(name: str, router_url: str, replica_urls: list[str], workload: RouterWorkload) -> RouterRun:
    """Send the workload through ``router_url``; read the hit rate off the replicas' /metrics."""
    before = [_counters(url) for url in replica_urls]
    prompts = workload.requests(tag=name)
    start = time.perf_counter()
    with httpx.Client() as client, ThreadPoolExecutor(workload.concurrency) as pool:
        ttfts = list(pool.map(lambda p: _ttft(client, router_url, p, workload.output_len), prompts))
    seconds = time.perf_counter() - start
    after = [_counters(url) for url in replica_urls]
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in before[0]}
    served = tuple(
        int(a["vllm:request_success_total"] - b["vllm:request_success_total"])
        for a, b in zip(after, before, strict=True)
    )
    hit_rate = delta["vllm:prefix_cache_hits_total"] / max(delta["vllm:prefix_cache_queries_total"], 1.0)
    quantiles = statistics.quantiles(ttfts, n=10)
    return RouterRun(name, hit_rate, statistics.median(ttfts), quantiles[-1], served, seconds)


def bench_router(config: RouterConfig) -> RouterResult:
    """The single replica with both replicas' KV first, then the pair under each policy."""
    from pagedkv.server.replicas import ReplicaSet

    engine, log = config.engine, subprocess.DEVNULL
    progress(f"router: {engine.num_kv_blocks} KV blocks of {engine.block_size} tokens per replica")
    runs = []
    single = replace(engine, num_kv_blocks=2 * engine.num_kv_blocks)
    progress("router: one replica with the KV of both")
    with ReplicaSet(single, 1, policy="round_robin", log=log) as one:
        runs.append(run_workload("single replica, 2x KV", one.url, one.replica_urls, config))
    with ReplicaSet(engine, 2, policy=POLICIES[0], log=log) as pair:
        for policy in POLICIES:
            if policy != pair.policy:
                pair.restart_router(policy)
            progress(f"router: two replicas, {policy}")
            runs.append(run_workload(f"2 replicas, {policy}", pair.url, pair.replica_urls, config))
    return RouterResult(config, runs)


def print_router(result: RouterResult, console: Console) -> None:
    """Each setup's hit rate, its share of the single replica's, TTFT and the requests' split."""
    ceiling = result.runs[0].hit_rate
    runs = table(
        "Prefix-cache hit rate and client-side TTFT per routing setup",
        ("setup", "hit rate", "of single", "TTFT p50", "TTFT p90", "requests", "wall"),
    )
    for run in result.runs:
        runs.add_row(
            run.name,
            f"{run.hit_rate:.1%}",
            f"{run.hit_rate / ceiling:.0%}" if ceiling else "-",
            f"{run.ttft_median_s * 1e3:.0f} ms",
            f"{run.ttft_p90_s * 1e3:.0f} ms",
            "/".join(str(n) for n in run.requests_per_replica),
            f"{run.seconds:.1f} s",
        )
    console.print(runs)
