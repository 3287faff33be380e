"""The dashboard's own figures on ``/metrics``: open pages, frames, and the engine worker's time
spent publishing them -- its cost, readable on a live server (``tools/dashboard_cost.py``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.server.dashboard.feed import DashboardFeed


class DashboardCollector(Collector):
    def __init__(self, feed: DashboardFeed) -> None:
        self.feed = feed

    def collect(self) -> Iterator[Metric]:
        pages = GaugeMetricFamily("pagedkv:dashboard_pages", "Dashboard pages with an open stream.")
        pages.add_metric([], self.feed.num_subscribers)
        frames = CounterMetricFamily("pagedkv:dashboard_frames", "Dashboard frames published.")
        frames.add_metric([], self.feed.frames_sent)
        seconds = CounterMetricFamily(
            "pagedkv:dashboard_publish_seconds",
            "Time the engine worker spent reading its state for the dashboard and sending it.",
        )
        seconds.add_metric([], self.feed.publish_seconds)
        yield from (pages, frames, seconds)
