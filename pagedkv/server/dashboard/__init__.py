"""The live KV block map: ``GET /dashboard`` (one self-contained page) and its event stream.

* :mod:`~pagedkv.server.dashboard.frames` -- the engine's state as plain data and the diffs;
* :mod:`~pagedkv.server.dashboard.feed` -- the worker thread's rate-limited fan-out to pages;
* :mod:`~pagedkv.server.dashboard.routes` -- the two routes;
* ``page/`` -- the page's markup, style and scripts (package data, inlined when served).
"""

from pagedkv.server.dashboard.feed import DashboardFeed
from pagedkv.server.dashboard.routes import STREAM_PATH, install_dashboard

__all__ = ["STREAM_PATH", "DashboardFeed", "install_dashboard"]
