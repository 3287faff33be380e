"""``pagedkv bench serve``: a serving benchmark in the style of vLLM's ``benchmark_serving``.

A seeded workload (prompts of random corpus words, fixed output lengths with ``ignore_eos``) is
sent as streaming completions whose arrival times follow a Poisson process at ``request_rate``
(or all at once) to one of the servers of :mod:`~pagedkv.bench.serve_servers`. From the client
side it measures what users feel: time to first token (TTFT), inter-token latency (ITL: gaps
between streamed chunks), time per output token, end-to-end latency and throughput. From the
server's ``/metrics`` it reads the peak KV-cache usage during the run (polled, and exact when
``pagedkv:kv_cache_usage_peak_perc`` rose during the run), preemptions and prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from pagedkv.bench.driver import table
from pagedkv.bench.options import check_options, option
from pagedkv.engine.config import EngineConfig
from pagedkv.server.cli import API_KEY_ENV

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
TARGET, WORKLOAD, RIVAL = "target", "workload", "side by side with vLLM"


@dataclass(frozen=True)
class ServeConfig:
    base_url: str | None = option(
        None, "a running server, e.g. http://127.0.0.1:8000 (default: start one)", group=TARGET
    )
    api_key: str | None = option(None, f"(default: ${API_KEY_ENV})", group=TARGET)
    served_model_name: str | None = option(
        None, "model name to request (default: the server's first)", group=TARGET
    )
    num_prompts: int = option(100, "requests", positive=True, group=WORKLOAD)
    request_rate: float = option(
        math.inf, "requests per second (Poisson), or inf", positive=True, group=WORKLOAD
    )
    max_concurrency: int | None = option(
        None, "most requests in flight (default: no cap)", positive=True, group=WORKLOAD
    )
    input_len: int = option(64, "prompt length in words", positive=True, group=WORKLOAD)
    output_len: int = option(32, "tokens to generate per request", positive=True, group=WORKLOAD)
    range_ratio: float = option(
        0.0, "lengths vary uniformly within +-ratio of --input-len/--output-len", group=WORKLOAD
    )
    seed: int = option(0, "workload seed", group=WORKLOAD)
    vllm_python: str | None = option(
        None,
        "python of a virtual environment with vLLM's CPU build: run the workload against "
        "`pagedkv serve` and vLLM's OpenAI server, each in its own process on --model, and print both",
        group=RIVAL,
    )
    threads: int | None = option(
        None, "CPU threads of each server (default: all)", positive=True, group=RIVAL
    )
    log_dir: Path = option(Path("bench-serve-logs"), "where the servers' logs go", group=RIVAL)
    timeout_s: float = 600.0
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        check_options(self)
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.vllm_python is not None and (self.engine.model is None or self.base_url is not None):
            raise ValueError(
                "--vllm-python needs --model (a Hugging Face folder both servers load) and no --base-url"
            )

    @property
    def key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV)


@dataclass(frozen=True)
class WorkItem:
    prompt: str
    output_len: int


def make_workload(config: ServeConfig) -> list[WorkItem]:
    """``num_prompts`` seeded prompts: the same config always gives the same requests."""
    from pagedkv.models.builtin.corpus import CORPUS

    rng, words = random.Random(config.seed), CORPUS.split()

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
class ServeResult:
    config: ServeConfig
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

    @property
    def ok(self) -> bool:
        return self.failed == 0

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


def metric_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named samples of a /metrics page (as exposed, ``_total`` included), summed over labels."""
    values = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    response.raise_for_status()
    return metric_values(response.text, _WATCHED)


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


async def _run(base_url: str, config: ServeConfig) -> ServeResult:
    workload = make_workload(config)
    arrivals = random.Random(config.seed + 1)
    headers = {"Authorization": f"Bearer {config.key}"} if config.key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=config.timeout_s, limits=limits
        ) as client,
        httpx.AsyncClient(base_url=base_url, timeout=30.0) as metrics_client,
    ):
        model = config.served_model_name
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
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
    peak_key = "pagedkv:kv_cache_usage_peak_perc"
    if after.get(peak_key, 0.0) > before.get(peak_key, 0.0):  # a new all-time peak: it was in this run
        peak[0] = max(peak[0], after[peak_key])
    return _result(
        base_url,
        model,
        config,
        results,
        duration,
        lambda name: after.get(name, 0.0) - before.get(name, 0.0),
        peak[0],
    )


def _result(base_url, model, config, results, duration, delta, peak) -> ServeResult:
    ok = [r for r in results if r.ok]
    queries = delta("vllm:prefix_cache_queries_total")
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [
        (r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None
    ]
    return ServeResult(
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
        tpot_ms=_summary(tpot),
        e2e_ms=_summary([r.latency for r in ok]),
        peak_kv_usage=peak,
        preemptions=int(delta("vllm:num_preemptions_total")),
        prefix_cache_hit_rate=delta("vllm:prefix_cache_hits_total") / queries if queries else 0.0,
    )


def run_benchmark(base_url: str, config: ServeConfig) -> ServeResult:
    """Run the workload against the server at ``base_url`` (blocking; its own event loop)."""
    return asyncio.run(_run(base_url.rstrip("/"), config))


def print_report(result, console: Console | None = None) -> None:
    """The summary and latency tables (or, for two servers, the comparison)."""
    console = console or Console()
    if not isinstance(result, ServeResult):  # two servers: their comparison
        result.report(console)
        return
    config = result.config
    rate = (
        "inf (all at once)" if math.isinf(config.request_rate) else f"{config.request_rate:g} req/s (Poisson)"
    )
    summary = table(
        f"pagedkv bench serve: {result.model} at {result.base_url}", ("metric", "value"), show_header=False
    )
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
    latency = table("Latency (ms)", ("", *result.ttft_ms))
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
