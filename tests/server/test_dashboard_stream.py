"""``GET /dashboard/stream``: what the frames say, how often they come, who gets them.

The frames are applied here as the page applies them (``page/model.js``) and compared with the
engine's own ``kv_snapshot()`` while :class:`~tests.server.helpers.EngineGate` holds it.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.server.helpers import MODEL, EngineGate, complete_in_background, prompts, wait_idle, wait_until
from tests.server.process import ServeProcess

OPTIONS = dict(num_kv_blocks=64, block_size=16, max_model_len=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def dashboard_server():
    with ServerThread(create_app(EngineConfig(**OPTIONS))) as running:
        yield running


class Page:
    """An open stream read in a thread, its frames applied the way the page applies them."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        self.frames: list[dict] = []
        self.blocks: list[int] = []
        self.seqs: dict[str, dict] = {}
        self.ended = threading.Event()
        self._response = None
        self.closed = False
        self._thread = threading.Thread(target=self._read, args=(base_url, headers or {}), daemon=True)
        self._thread.start()
        wait_until(lambda: self.frames, 60, "the first frame")

    def _read(self, base_url: str, headers: dict[str, str]) -> None:
        url = f"{base_url}/dashboard/stream"
        try:
            with httpx.stream("GET", url, headers=headers, timeout=None) as response:
                self._response = response
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self._apply(json.loads(line[len("data: ") :]))
        except httpx.ReadError:
            assert self.closed  # only :meth:`close` cuts a stream short
        self.ended.set()

    def _apply(self, frame: dict) -> None:
        if frame["kind"] == "full":
            self.blocks, self.seqs = list(frame["blocks"]), dict(frame["seqs"])
        else:
            changed = frame["blocks"]
            for block, code in zip(changed[::2], changed[1::2], strict=True):
                self.blocks[block] = code
            for key, fields in frame["seqs"].items():
                self.seqs[key] = {**self.seqs.get(key, {}), **fields}
            for key in frame["gone"]:
                del self.seqs[key]
        self.frames.append(frame)

    def matches(self, engine) -> bool:
        snapshot = engine.kv_snapshot()
        blocks = [b.refcount * 2 + b.cached for b in snapshot.blocks]
        seqs = {f"{s.request_id}#{s.index}": (list(s.block_ids), s.num_tokens) for s in snapshot.sequences}
        return self.blocks == blocks and {k: (s["b"], s["n"]) for k, s in self.seqs.items()} == seqs

    def close(self) -> None:
        self.closed = True
        if self._response is not None:
            self._response.close()


def test_the_frames_rebuild_the_engines_block_map_at_most_ten_times_a_second(dashboard_server):
    engine = dashboard_server.app.state.engine.engine
    base_url = dashboard_server.base_url
    pages = [Page(base_url), Page(base_url)]  # several pages at once
    first = pages[0].frames[0]
    assert first["kind"] == "full" and first["config"]["numBlocks"] == len(first["blocks"]) == 64
    with EngineGate(engine) as gate:
        gate.close()
        threads = [
            complete_in_background(base_url, prompt=p, max_tokens=40, n=2, ignore_eos=True)
            for p in prompts(3, seed=7, words=25)
        ]
        for _ in range(6):  # a few steps, each held until both pages show it exactly
            gate.open_until(lambda outputs: True)
            assert gate.holding.wait(60)
            for page in pages:
                wait_until(lambda page=page: page.matches(engine), 30, "the page to match the engine")
        assert any(code >> 1 > 1 for code in pages[0].blocks), "forked samples share blocks"
    for thread in threads:
        thread.join(120)
    wait_idle(base_url)
    for page in pages:
        wait_until(lambda page=page: page.matches(engine) and not page.seqs, 30, "the pool back")
        times = [frame["stats"]["t"] for frame in page.frames]
        assert all(later - earlier >= 0.099 for earlier, later in zip(times, times[1:], strict=False)), times
        assert all(frame["kind"] == "diff" for frame in page.frames[1:])
        page.close()


def test_a_page_that_stops_reading_is_dropped_and_the_engine_goes_on(dashboard_server):
    engine = dashboard_server.app.state.engine.engine
    base_url = dashboard_server.base_url
    feed = dashboard_server.app.state.dashboard

    async def stall() -> None:
        feed.buffer_frames = 3
        try:
            stalled = feed.subscribe()  # never read
        finally:
            feed.buffer_frames = 50
        reading = Page(base_url)
        frames_seen = len(reading.frames)  # before the request: its frames must reach this page
        with EngineGate(engine) as gate:
            gate.close()  # the worker loops without stepping: the feed keeps publishing
            thread = complete_in_background(base_url, prompt="stall", max_tokens=20, ignore_eos=True)
            while stalled.ended is None:
                await asyncio.sleep(0.01)
            assert stalled.ended.startswith("dropped") and not stalled.frames
        thread.join(120)  # the engine ran the request to its end
        assert thread.is_alive() is False
        feed.unsubscribe(stalled)
        wait_idle(base_url)
        wait_until(lambda: reading.matches(engine) and not reading.seqs, 30, "the reading page to go on")
        assert len(reading.frames) > frames_seen and not reading.ended.is_set()
        reading.close()

    asyncio.run(stall())
    wait_until(lambda: feed.num_subscribers == 0, 30, "the closed pages to be forgotten")


def test_with_no_page_open_the_feed_does_nothing(dashboard_server):
    feed = dashboard_server.app.state.dashboard
    wait_until(lambda: feed.num_subscribers == 0, 30, "no page open")
    sent = feed.frames_sent
    body = {"model": MODEL, "prompt": "nobody watches", "max_tokens": 8}
    assert httpx.post(f"{dashboard_server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    assert feed.frames_sent == sent


def test_ctrl_c_ends_open_streams_and_the_server_exits():
    """uvicorn waits for open responses before it stops; an open page must not keep it up."""
    with ServeProcess("--num-kv-blocks", "32", "--max-model-len", "128", "--api-key", "k") as server:
        assert httpx.get(f"{server.base_url}/dashboard/stream").status_code == 401
        page = Page(server.base_url, headers={"Authorization": "Bearer k"})
    assert server.returncode == 0
    assert page.ended.wait(30)
    assert "/dashboard" in server.stderr  # the start-up line says where the page is
