"""``pagedkv bench serve``: a serving benchmark in the style of vLLM's ``benchmark_serving``.

A seeded workload (prompts of random corpus words, fixed output lengths with ``ignore_eos``)
is sent as streaming completions whose arrival times follow a Poisson process at
``request_rate`` (or all at once). From the client side it measures what users feel: time to
first token (TTFT), inter-token latency (ITL: gaps between streamed chunks), time per output
token, end-to-end latency and throughput. From the server's ``/metrics`` it reads the peak
KV-cache usage during the run (polled, and exact when ``pagedkv:kv_cache_usage_peak_perc``
rose during the run), preemptions and prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from pagedkv.models.corpus import CORPUS

#: /metrics samples read for the report (names as exposed, after the ``_total`` suffix).
_WATCHED = (
    "vllm:kv_cache_usage_perc",
    "pagedkv:kv_cache_usage_peak_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)
PERCENTILES = (50, 90, 99)
METRICS_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class BenchConfig:
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_len: int = 64
    output_len: int = 32
    range_ratio: float = 0.0
    seed: int = 0
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"num_prompts, input_len and output_len must be >= 1, got "
                f"{self.num_prompts}, {self.input_len}, {self.output_len}"
            )
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class WorkItem:
    prompt: str
    output_len: int


def make_workload(config: BenchConfig) -> list[WorkItem]:
    """``num_prompts`` seeded prompts: the same config always gives the same requests."""
    rng = random.Random(config.seed)
    words = CORPUS.split()

    def length(center: int) -> int:
        spread = int(center * config.range_ratio)
        return max(1, rng.randint(center - spread, center + spread))

    return [
        WorkItem(
            " ".join(rng.choice(words) for _ in range(length(config.input_len))), length(config.output_len)
        )
        for _ in range(config.num_prompts)
    ]


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


@dataclass
class BenchResult:
    config: BenchConfig
    base_url: str
    model: str
    duration_s: float
    completed: int
    failed: int
    errors: list[str]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    #: {"mean": .., "p50": .., "p90": .., "p99": ..} in milliseconds.
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms: dict[str, float]
    peak_kv_usage: float
    preemptions: int
    prefix_cache_hit_rate: float

    def to_json(self) -> dict:
        out = asdict(self)
        out["config"]["request_rate"] = str(self.config.request_rate)  # JSON has no inf
        out["config"].pop("api_key")
        return out


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in _WATCHED:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def _poll_kv_usage(client: httpx.AsyncClient, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            peak[0] = max(peak[0], (await _scrape(client)).get("vllm:kv_cache_usage_perc", 0.0))
        except httpx.HTTPError:
            pass  # a missed sample only makes the polled peak coarser
        try:
            await asyncio.wait_for(stop.wait(), METRICS_POLL_SECONDS)
        except asyncio.TimeoutError:
            pass


async def _send(client: httpx.AsyncClient, model: str, item: WorkItem, seed: int) -> RequestResult:
    payload = {
        "model": model,
        "prompt": item.prompt,
        "max_tokens": item.output_len,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.output_tokens > 0
    if not result.ok:
        result.error = "the stream ended without a usage chunk"
    return result


async def _model_name(client: httpx.AsyncClient, config: BenchConfig) -> str:
    if config.model is not None:
        return config.model
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _run(base_url: str, config: BenchConfig) -> BenchResult:
    workload = make_workload(config)
    arrivals = random.Random(config.seed + 1)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=config.timeout_s, limits=limits
        ) as client,
        httpx.AsyncClient(base_url=base_url, timeout=30.0) as metrics_client,
    ):
        model = await _model_name(client, config)
        before = await _scrape(metrics_client)
        peak, stop = [0.0], asyncio.Event()
        poller = asyncio.create_task(_poll_kv_usage(metrics_client, peak, stop))
        gate = asyncio.Semaphore(config.max_concurrency or config.num_prompts)

        async def one(i: int, item: WorkItem) -> RequestResult:
            async with gate:
                return await _send(client, model, item, config.seed + i)

        start = time.perf_counter()
        tasks = []
        for i, item in enumerate(workload):
            tasks.append(asyncio.create_task(one(i, item)))
            if not math.isinf(config.request_rate) and i + 1 < len(workload):
                await asyncio.sleep(arrivals.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop.set()
        await poller
        after = await _scrape(metrics_client)
    return _report(base_url, model, config, results, duration, before, after, peak[0])


def _report(base_url, model, config, results, duration, before, after, polled_peak) -> BenchResult:
    ok = [r for r in results if r.ok]
    peak_key = "pagedkv:kv_cache_usage_peak_perc"
    peak = polled_peak
    if after.get(peak_key, 0.0) > before.get(peak_key, 0.0):
        peak = max(peak, after[peak_key])  # a new all-time peak: it happened during this run

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("vllm:prefix_cache_queries_total")
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return BenchResult(
        config=config,
        base_url=base_url,
        model=model,
        duration_s=duration,
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=sorted({r.error for r in results if r.error})[:5],
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=_summary([r.ttft for r in ok if r.ttft is not None]),
        itl_ms=_summary([gap for r in ok for gap in r.itl]),
        tpot_ms=_summary(
            [
                (r.latency - r.ttft) / (r.output_tokens - 1)
                for r in ok
                if r.output_tokens > 1 and r.ttft is not None
            ]
        ),
        e2e_ms=_summary([r.latency for r in ok]),
        peak_kv_usage=peak,
        preemptions=int(delta("vllm:num_preemptions_total")),
        prefix_cache_hit_rate=delta("vllm:prefix_cache_hits_total") / queries if queries else 0.0,
    )


def run_benchmark(base_url: str, config: BenchConfig) -> BenchResult:
    """Run the workload against the server at ``base_url`` (blocking; its own event loop)."""
    return asyncio.run(_run(base_url.rstrip("/"), config))


def print_report(result: BenchResult, console: Console | None = None) -> None:
    console = console or Console()
    config = result.config
    rate = (
        "inf (all at once)" if math.isinf(config.request_rate) else f"{config.request_rate:g} req/s (Poisson)"
    )
    summary = Table(title=f"pagedkv bench serve: {result.model} at {result.base_url}", show_header=False)
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    for row in (
        ("Request rate", rate),
        ("Successful / failed requests", f"{result.completed} / {result.failed}"),
        ("Duration (s)", f"{result.duration_s:.2f}"),
        ("Input / output tokens", f"{result.total_input_tokens} / {result.total_output_tokens}"),
        ("Request throughput (req/s)", f"{result.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{result.output_throughput:.1f}"),
        ("Total token throughput (tok/s)", f"{result.total_token_throughput:.1f}"),
        ("Peak KV-cache usage", f"{result.peak_kv_usage:.1%}"),
        ("Preemptions", str(result.preemptions)),
        ("Prefix-cache hit rate", f"{result.prefix_cache_hit_rate:.1%}"),
    ):
        summary.add_row(*row)
    latency = Table(title="Latency (ms)")
    latency.add_column("")
    for key in result.ttft_ms:
        latency.add_column(key, justify="right")
    for label, stats in (
        ("Time to first token", result.ttft_ms),
        ("Inter-token latency", result.itl_ms),
        ("Time per output token", result.tpot_ms),
        ("End-to-end latency", result.e2e_ms),
    ):
        latency.add_row(label, *(f"{value:.1f}" for value in stats.values()))
    console.print(summary)
    console.print(latency)
    for error in result.errors:
        console.print(f"[red]error:[/] {error}")
