"""``pagedkv bench router``: prefix-cache hit rate and TTFT of 2 replicas under vllm-router's policies.

The workload is the one KV-aware routing exists for: a few long system prompts, each shared by
many users (8 x 32 by default), sent in a shuffled order by a fixed number of concurrent clients.
Each replica's KV cache holds about half of the system prompts, so where a prompt is sent decides
whether its prefix is still cached there. The same workload runs against

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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.engine import EngineConfig
from pagedkv.server.replicas import ReplicaSet

POLICIES = ("round_robin", "cache_aware", "kv_aware")
_WORDS = (
    "module function class socket thread process buffer stream parser encoder archive path file "
    "signal queue lock event timer cache index table record field value token block string"
).split()


@dataclass(frozen=True)
class RouterWorkload:
    num_systems: int = 8
    users_per_system: int = 32
    system_words: int = 90
    user_words: int = 8
    output_len: int = 4
    concurrency: int = 4
    seed: int = 0

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
class RouterRun:
    name: str
    hit_rate: float
    ttft_median_s: float
    ttft_p90_s: float
    requests_per_replica: tuple[int, ...]
    seconds: float


def _counters(url: str) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:request_success")
    values = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if family.name in wanted:
            values[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return values


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
        int(a["vllm:request_success"] - b["vllm:request_success"]) for a, b in zip(after, before, strict=True)
    )
    hit_rate = delta["vllm:prefix_cache_hits"] / max(delta["vllm:prefix_cache_queries"], 1.0)
    quantiles = statistics.quantiles(ttfts, n=10)
    return RouterRun(name, hit_rate, statistics.median(ttfts), quantiles[-1], served, seconds)


def bench_router(engine: EngineConfig, workload: RouterWorkload, log=None) -> list[RouterRun]:
    """The single replica with both replicas' KV first, then the pair under each policy."""
    runs = []
    single = replace(engine, num_kv_blocks=2 * engine.num_kv_blocks)
    with ReplicaSet(single, 1, policy="round_robin", log=log) as one:
        runs.append(run_workload("single replica, 2x KV", one.url, one.replica_urls, workload))
    with ReplicaSet(engine, 2, policy=POLICIES[0], log=log) as pair:
        for policy in POLICIES:
            if policy != pair.policy:
                pair.restart_router(policy)
            runs.append(run_workload(f"2 replicas, {policy}", pair.url, pair.replica_urls, workload))
    return runs


def format_runs(runs: list[RouterRun]) -> str:
    ceiling = runs[0].hit_rate
    header = ("hit rate", "of single", "TTFT p50", "TTFT p90", "requests", "wall")
    lines = [f"{'setup':<26} " + " ".join(f"{h:>9}" for h in header)]
    for run in runs:
        share = run.hit_rate / ceiling if ceiling else float("nan")
        split = "/".join(str(n) for n in run.requests_per_replica)
        lines.append(
            f"{run.name:<26} {run.hit_rate:>9.1%} {share:>9.0%} {run.ttft_median_s * 1e3:>7.0f}ms "
            f"{run.ttft_p90_s * 1e3:>7.0f}ms {split:>9} {run.seconds:>8.1f}s"
        )
    return "\n".join(lines)
