"""Prometheus metrics under vLLM's names, so existing vLLM dashboards read a pagedkv server.

Gauges and counters that the engine already keeps (KV usage, queue lengths, preemptions,
prefix-cache tokens, token counts) are read from the worker's latest statistics snapshot when
``/metrics`` is scraped: nothing is copied per step. Latencies (time to first token, inter-token
latency, end-to-end) are histograms the worker observes as tokens arrive. Each app has its own
``CollectorRegistry``, so several servers in one process (tests, the benchmark) never mix.

``pagedkv:kv_cache_usage_peak_perc`` (highest usage since start) has no vLLM counterpart; it
lets ``pagedkv bench serve`` report the peak without depending on its polling rate. With a
second KV tier: vLLM's external prefix cache and KV offload series (tokens looked up in and
loaded from the tier; bytes and seconds moved, by transfer type and by direction) and
pagedkv's own for what vLLM has no name for (the tier's blocks, preemptions by swap and by
recompute).

A speculating engine adds vLLM's speculative-decoding counters, ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos``
(labelled ``position``, 0-based); the acceptance rate (accepted / draft tokens) and the mean
acceptance length (1 + accepted / drafts) are ratios of them, as vLLM leaves them to PromQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.engine.spec.metrics import SpecDecodingStats

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error")

#: (name, help, key in the stats snapshot) of the gauges read at scrape time.
GAUGES = (
    (
        "vllm:kv_cache_usage_perc",
        "KV-cache usage: the fraction of KV blocks in use (1 = full).",
        "utilization",
    ),
    ("vllm:num_requests_running", "Sequences in the running batch.", "running"),
    ("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", "waiting"),
    (
        "pagedkv:kv_cache_usage_peak_perc",
        "Highest KV-cache usage since the server started.",
        "peak_utilization",
    ),
    ("pagedkv:kv_cache_blocks_total", "KV blocks in the pool.", "blocks_total"),
    ("pagedkv:kv_cache_blocks_used", "KV blocks held by requests.", "blocks_used"),
)
#: (name without _total, help, key) of the counters read at scrape time.
COUNTERS = (
    ("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.", "preemptions"),
    (
        "pagedkv:num_preemptions_swapped",
        "Preemptions by swap: the blocks went to the second KV tier and come back.",
        "preemptions_swapped",
    ),
    (
        "pagedkv:num_preemptions_recomputed",
        "Preemptions by recompute: the tokens the prefix cache does not keep are computed again.",
        "preemptions_recomputed",
    ),
    (
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries_tokens",
    ),
    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits_tokens"),
    ("vllm:prompt_tokens", "Prompt tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Tokens generated.", "generation_tokens"),
)

#: The second KV tier's counters (when there is one): (name without _total, help, key).
TIER_COUNTERS = (
    (
        "vllm:external_prefix_cache_queries",
        "Prompt tokens looked up in the second KV tier.",
        "tier_queries_tokens",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "Prompt tokens loaded from the second KV tier instead of computed.",
        "tier_hits_tokens",
    ),
    (
        "vllm:kv_offload_store_bytes",
        "Bytes of KV blocks moved from the pool to the second tier.",
        "tier_bytes_out",
    ),
    (
        "vllm:kv_offload_load_bytes",
        "Bytes of KV blocks moved from the second tier to the pool.",
        "tier_bytes_in",
    ),
    (
        "vllm:kv_offload_store_time",
        "Seconds steps spent moving KV blocks to the second tier.",
        "tier_seconds_out",
    ),
    ("vllm:kv_offload_load_time", "Seconds steps spent moving KV blocks into the pool.", "tier_seconds_in"),
    (
        "pagedkv:kv_offload_evictions",
        "Blocks the second KV tier evicted (least recently used).",
        "tier_evictions",
    ),
    (
        "pagedkv:kv_offload_load_failures",
        "Sequences whose load from the second tier failed its check (they recomputed).",
        "tier_load_failures",
    ),
)
#: The second KV tier's gauges: (name, help, key).
TIER_GAUGES = (
    ("pagedkv:kv_offload_usage_perc", "Second KV tier: share of its slots held (1 = full).", "tier_usage"),
    ("pagedkv:kv_offload_blocks_total", "Second KV tier: block slots.", "tier_blocks_total"),
    ("pagedkv:kv_offload_blocks_cached", "Second KV tier: prefix blocks held.", "tier_blocks_cached"),
    ("pagedkv:kv_offload_blocks_swap", "Second KV tier: blocks of swapped-out requests.", "tier_blocks_swap"),
)


def _tier_metrics(model_name: str, stats: Mapping[str, float]) -> Iterator[Metric]:
    """The second tier's series, and vLLM's ``kv_offload_total_bytes`` / ``_time`` by transfer
    type (``GPU_to_CPU``, ``CPU_to_GPU``; ``DISK`` for the disk tier; the pool is "GPU")."""
    for name, documentation, key in TIER_COUNTERS:
        counter = CounterMetricFamily(name, documentation, labels=["model_name"])
        counter.add_metric([model_name], stats[key])
        yield counter
    for name, documentation, key in TIER_GAUGES:
        gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
        gauge.add_metric([model_name], stats[key])
        yield gauge
    medium = stats["tier_medium"]
    directions = ((f"GPU_to_{medium}", "out"), (f"{medium}_to_GPU", "in"))
    for what, unit in (("bytes", "Bytes"), ("time", "Seconds")):
        counter = CounterMetricFamily(
            f"vllm:kv_offload_total_{what}",
            f"{unit} of KV blocks moved between the pool and the second tier, by transfer type.",
            labels=["model_name", "transfer_type"],
        )
        for transfer_type, direction in directions:
            key = f"tier_bytes_{direction}" if what == "bytes" else f"tier_seconds_{direction}"
            counter.add_metric([model_name, transfer_type], stats[key])
        yield counter


class _EngineStatsCollector(Collector):
    """Gauges and counters straight from the engine's statistics snapshot."""

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, float]]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for name, documentation, key in GAUGES:
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric([self.model_name], stats[key])
            yield gauge
        for name, documentation, key in COUNTERS:
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric([self.model_name], stats[key])
            yield counter
        if "tier_medium" in stats:
            yield from _tier_metrics(self.model_name, stats)


#: (name without _total, help, field of SpecDecodingStats) of the speculation counters.
SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Drafts verified (one per speculating sequence and step).", "num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", "num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens the target model kept.", "num_accepted_tokens"),
)


class _SpecDecodingCollector(Collector):
    """Speculative decoding's counters, from the engine's totals (nothing when it does not speculate)."""

    def __init__(self, model_name: str, spec_decoding: Callable[[], SpecDecodingStats | None]) -> None:
        self.model_name = model_name
        self.spec_decoding = spec_decoding

    def collect(self) -> Iterator[Metric]:
        totals = self.spec_decoding()
        if totals is None:
            return
        for name, documentation, attribute in SPEC_COUNTERS:
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric([self.model_name], getattr(totals, attribute))
            yield counter
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Drafts that kept their proposed token at each position (0-based).",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(totals.num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos


class ServerMetrics:
    """The registry of one server; the worker calls ``observe_*``, ``/metrics`` calls ``render``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            """This model's series of a latency histogram."""
            family = Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)
            return family.labels(model_name)

        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Time from receiving a request to its first generated token.",
            TTFT_BUCKETS,
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between successive outputs of a request.", ITL_BUCKETS
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Time from receiving a request to its end.", E2E_BUCKETS
        )
        self._finished = Counter(
            "vllm:request_success",
            "Requests ended, by finish reason (stop, length, abort, error).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self._finished.labels(model_name, reason)

    def watch(
        self,
        stats: Callable[[], Mapping[str, float]],
        spec_decoding: Callable[[], SpecDecodingStats | None] = lambda: None,
    ) -> None:
        """Expose the gauges and counters of ``stats()`` (the engine's snapshot) and the
        speculation counters of ``spec_decoding()`` (when not None) on every scrape."""
        self.registry.register(_EngineStatsCollector(self.model_name, stats))
        self.registry.register(_SpecDecodingCollector(self.model_name, spec_decoding))

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, seconds: float, reason: str) -> None:
        self._e2e.observe(seconds)
        self._finished.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
