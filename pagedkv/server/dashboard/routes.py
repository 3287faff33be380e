"""``GET /dashboard`` and ``GET /dashboard/stream`` on a server's app.

The page is static -- markup, style and scripts, no data -- so it is served to anyone, like a
login form; everything it shows comes through the stream, which the API key middleware guards
like ``/v1`` when the server has a key. The page sends the key in an ``Authorization`` header
(``fetch`` reading the event stream), never in a URL query, so it never reaches an access log.

The page keeps the key in ``sessionStorage``, so it runs nothing it did not come with: its
Content-Security-Policy allows only its own inline script and style (by their SHA-256), requests
to this server, and no framing (``frame-ancestors 'none'``, and ``X-Frame-Options`` for older
browsers).
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import AsyncIterator
from functools import cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse

from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.dashboard.feed import DashboardFeed, Subscriber
from pagedkv.server.dashboard.metrics import DashboardCollector
from pagedkv.server.metrics import ServerMetrics

PAGE_PATH = "/dashboard"
STREAM_PATH = "/dashboard/stream"
#: A comment line this often keeps proxies from closing a quiet stream and finds closed pages.
KEEPALIVE_S = 10.0
_PAGE = files("pagedkv.server.dashboard") / "page"
#: In this order: each script uses only what the ones before it define.
_SCRIPTS = ("model.js", "charts.js", "views.js", "detail.js", "stream.js", "main.js")


def _sha256_source(text: str) -> str:
    """A CSP source that allows exactly the inline element whose content is ``text``."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@cache
def render_page(requires_key: bool) -> tuple[str, dict[str, str]]:
    """The page with its style and scripts inline -- one response, nothing else to fetch -- and
    the headers it is served with. ``requires_key`` makes it ask for the key before it connects."""
    html = (_PAGE / "dashboard.html").read_text(encoding="utf-8")
    style = (_PAGE / "dashboard.css").read_text(encoding="utf-8")
    script = "\n".join((_PAGE / name).read_text(encoding="utf-8") for name in _SCRIPTS)
    for marker in ("<style>/*@STYLE@*/</style>", "<script>/*@SCRIPT@*/</script>"):
        if html.count(marker) != 1:
            raise RuntimeError(f"the dashboard template must hold {marker} exactly once")
    html = html.replace("@REQUIRES_KEY@", "true" if requires_key else "false")
    policy = (
        f"default-src 'none'; script-src {_sha256_source(script)}; style-src {_sha256_source(style)}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    headers = {
        "Cache-Control": "no-store",
        "Content-Security-Policy": policy,
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }
    return html.replace("/*@STYLE@*/", style).replace("/*@SCRIPT@*/", script), headers


async def _events(feed: DashboardFeed, subscriber: Subscriber) -> AsyncIterator[str]:
    try:
        yield ": pagedkv dashboard\n\n"  # the page sees the stream open before the first frame
        while subscriber.ended is None:
            frames = await subscriber.next_frames(KEEPALIVE_S)
            for frame in frames:
                yield frame
            if not frames and subscriber.ended is None:
                yield ": keepalive\n\n"
    finally:  # the page left, was dropped, or the server stops
        feed.unsubscribe(subscriber)


def install_dashboard(
    app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics, model_name: str, requires_key: bool
) -> DashboardFeed:
    """Add the two routes to ``app``, the feed to ``engine``'s observers and its figures to
    ``metrics``; return the feed."""
    inner = engine.engine
    config = {
        "model": model_name,
        "numBlocks": int(engine.stats["blocks_total"]),
        "blockSize": int(engine.stats["block_size"]),
        "maxModelLen": inner.max_model_len,
        "maxNumSeqs": inner.settings.scheduler.max_num_seqs,
        #: Per KV group its window (null: full attention); empty without groups.
        "kvGroups": list(inner.kv_manager.group_windows),
        "nullBlock": inner.kv_manager.null_block,
        #: Changes when the server restarts: the page starts its picture afresh.
        "boot": uuid.uuid4().hex[:12],
    }
    feed = DashboardFeed(config, engine.wake)
    engine.observers.append(feed)
    metrics.registry.register(DashboardCollector(feed))
    app.state.dashboard = feed

    @app.get(PAGE_PATH, include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        html, headers = render_page(requires_key)
        return HTMLResponse(html, headers=headers)

    @app.get(STREAM_PATH, include_in_schema=False)
    async def dashboard_stream() -> StreamingResponse:
        return StreamingResponse(
            _events(feed, feed.subscribe()),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return feed
