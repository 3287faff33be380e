"""Bounded logs: a warning that can repeat per request, per file or per write is written at most
once per interval, and the lines it held back are counted, never lost.

A condition that lasts -- a full disk, a folder of another model's files, a flood of bad
connections -- would otherwise write a line per occurrence: megabytes a minute that bury every
other line. :class:`Throttle` decides, per key, which occurrence is written (the first, then the
first after each interval) and counts the others; :class:`ThrottledLog` writes through it, each
line saying how many of its kind were held back since the last one, and :meth:`ThrottledLog.flush`
reports what is still held when the condition ends (at shutdown), so a count is never dropped.
Thread safe: writer threads and the event loop share one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

#: At most one line of a kind per this many seconds.
LOG_INTERVAL_S = 10.0


class Throttle:
    """Per key: one occurrence passes per ``interval`` seconds; the others are counted."""

    def __init__(self, interval: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[Hashable, tuple[float, int]] = {}  # key -> (last passed, held back since)

    def admit(self, key: Hashable) -> int | None:
        """None: hold this occurrence back (counted). Otherwise it passes, and the result is how
        many of ``key`` were held back since the last one that passed."""
        now = self._clock()
        with self._lock:
            passed, held = self._last.get(key, (-float("inf"), 0))
            if now - passed < self.interval:
                self._last[key] = (passed, held + 1)
                return None
            self._last[key] = (now, 0)
            return held

    def take_held(self) -> dict[Hashable, int]:
        """The occurrences held back since each key last passed, now counted as reported."""
        with self._lock:
            held = {key: count for key, (_, count) in self._last.items() if count}
            for key in held:
                self._last[key] = (self._last[key][0], 0)
        return held


def held_note(held: int) -> str:
    """The suffix of a line that follows ``held`` lines of its kind held back."""
    return f" ({held} more since the last of these)" if held else ""


class ThrottledLog:
    """Writes ``logger``'s repeated lines through a :class:`Throttle`, one key per kind of line,
    each starting with ``prefix`` (e.g. "KV tier")."""

    def __init__(self, logger: logging.Logger, prefix: str, interval: float = LOG_INTERVAL_S) -> None:
        self.logger = logger
        self.prefix = prefix
        self.throttle = Throttle(interval)
        #: what each key's lines are about, for :meth:`flush`'s summary
        self._kinds: dict[Hashable, str] = {}

    def warning(self, key: Hashable, kind: str, message: str, *args: object) -> bool:
        """Write ``prefix: message % args`` unless a line of ``key`` was written within the
        interval; ``kind`` names such lines in a summary (e.g. "failed writes"). True if written."""
        self._kinds[key] = kind
        held = self.throttle.admit(key)
        if held is None:
            return False
        self.logger.warning(f"{self.prefix}: {message}{held_note(held)}", *args)
        return True

    def flush(self) -> None:
        """One line for what is still held back, by kind (e.g. when the tier closes)."""
        held = self.throttle.take_held()
        if held:
            parts = ", ".join(f"{count} more {self._kinds[key]}" for key, count in held.items())
            self.logger.warning("%s: %s since the last line of each was logged", self.prefix, parts)
