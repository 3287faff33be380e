"""From the engine's worker thread to every open dashboard: a bounded, rate-limited fan-out.

The worker calls :meth:`DashboardFeed.observe` after every loop. With no page open that is one
attribute test; with pages open it takes a :class:`~pagedkv.server.dashboard.frames.View` at most
``1 / max_rate`` times a second, diffs it against the last one, encodes the frame once and hands
the same text to every page's buffer. Handing over is ``call_soon_threadsafe``: the worker never
waits for a page. A page whose buffer is full -- it stopped reading, its network is slow -- is
dropped (its stream ends); its script reconnects and starts again from a full frame. Pages that
join get a full frame at the next publication, which :meth:`subscribe` asks for at once by waking
an idle worker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pagedkv.engine import LLMEngine
from pagedkv.server.dashboard.frames import View, diff_frame, encode, full_frame, take_view

#: Frames a second at most, whatever the engine's step rate.
DEFAULT_MAX_RATE = 10.0
#: Frames a page may have unread before it is dropped (a few seconds at the full rate).
DEFAULT_BUFFER_FRAMES = 50


class Subscriber:
    """One open page: its unread frames, on the event loop that serves its stream."""

    def __init__(self, max_frames: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.max_frames = max_frames
        self.frames: deque[str] = deque()
        #: Why the stream ends (set once): dropped as too slow, or the server is stopping.
        self.ended: str | None = None
        self._ready = asyncio.Event()

    def offer(self, frame: str) -> None:
        """Event loop only. Over the limit the page is dropped rather than the frame queued."""
        if self.ended is not None:
            return
        if len(self.frames) >= self.max_frames:
            self.end("dropped: the page did not keep up")
            return
        self.frames.append(frame)
        self._ready.set()

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
            self.frames.clear()
        self._ready.set()

    async def next_frames(self, timeout: float) -> list[str]:
        """The unread frames (empty after ``timeout`` seconds without one, or once ended)."""
        if not self.frames and self.ended is None:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return []
        self._ready.clear()
        frames = list(self.frames)
        self.frames.clear()
        return frames


class DashboardFeed:
    """Publishes the engine's state to the subscribed pages (an ``EngineObserver``)."""

    def __init__(
        self,
        config: dict[str, Any],
        wake: Callable[[], None],
        max_rate: float = DEFAULT_MAX_RATE,
        buffer_frames: int = DEFAULT_BUFFER_FRAMES,
    ) -> None:
        if max_rate <= 0:
            raise ValueError(f"max_rate must be positive, got {max_rate}")
        self.config = config
        self.interval = 1.0 / max_rate
        self.buffer_frames = buffer_frames
        self._wake = wake
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []
        self._joining: list[Subscriber] = []
        self._previous: View | None = None
        self._last_sent = -float("inf")
        #: The engine ran since the last frame: an idle worker still owes the pages one.
        self._dirty = False
        #: Frames published, and the worker's time spent publishing them, since the server
        #: started: what an open page costs the engine (``/metrics``, the tests).
        self.frames_sent = 0
        self.publish_seconds = 0.0

    # -- the event loop's side --------------------------------------------------------------
    def subscribe(self) -> Subscriber:
        subscriber = Subscriber(self.buffer_frames)
        with self._lock:
            self._joining.append(subscriber)
        self._wake()
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        with self._lock:
            for group in (self._subscribers, self._joining):
                if subscriber in group:
                    group.remove(subscriber)

    def close(self) -> None:
        """End every stream (the server is stopping: uvicorn waits for open responses)."""
        with self._lock:
            subscribers = self._subscribers + self._joining
            self._subscribers, self._joining = [], []
        for subscriber in subscribers:
            subscriber.loop.call_soon_threadsafe(subscriber.end, "the server is stopping")

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers) + len(self._joining)

    # -- the worker thread's side -----------------------------------------------------------
    def due_in(self) -> float | None:
        with self._lock:
            owed = self._joining or (self._subscribers and self._dirty)
        if not owed:
            return None
        return max(0.0, self._last_sent + self.interval - time.monotonic())

    def observe(self, engine: LLMEngine) -> None:
        if not (self._subscribers or self._joining):
            self._previous = None  # the next page starts from a fresh full frame anyway
            return
        self._dirty = True
        now, stamp = time.monotonic(), time.time()
        if now - self._last_sent < self.interval:
            return
        started = time.perf_counter()
        view = take_view(engine, stamp)
        with self._lock:
            joining, self._joining = self._joining, []
            listening = list(self._subscribers)
            self._subscribers += joining
        if listening and self._previous is not None:
            self._send(listening, encode(diff_frame(self._previous, view)))
        if joining:
            self._send(joining, encode(full_frame(view, self.config)))
        self._previous, self._last_sent, self._dirty = view, now, False
        self.frames_sent += 1
        self.publish_seconds += time.perf_counter() - started

    def _send(self, subscribers: list[Subscriber], frame: str) -> None:
        dropped = []
        for subscriber in subscribers:
            try:
                subscriber.loop.call_soon_threadsafe(subscriber.offer, frame)
            except RuntimeError:  # its loop closed: nobody reads it any more
                dropped.append(subscriber)
        for subscriber in dropped:
            self.unsubscribe(subscriber)
