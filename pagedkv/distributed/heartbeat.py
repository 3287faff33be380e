"""Telling a rank that hangs from one that only waits for it.

When a collective times out every live rank was waiting, so the error alone does not say who
is to blame. Each worker's heartbeat thread bumps a counter in the rendezvous store (torch's own
``TCPStore``) every :data:`INTERVAL` seconds: a rank stopped by a signal, dead on another machine
or frozen stops bumping it. The thread also ends a spawned worker whose parent is gone, so no
rank outlives the engine that started it.
"""

from __future__ import annotations

import os
import threading
import time

import torch.distributed as dist

from pagedkv.distributed import groups
from pagedkv.distributed.rendezvous import Rendezvous

INTERVAL = 0.5
_BEAT = "pagedkv/heartbeat/{}"
_ERROR = "pagedkv/error/{}"


def connect(rendezvous: Rendezvous) -> dist.TCPStore:
    """A client of the rendezvous store (rank 0's, or torchrun's agent's)."""
    return groups.store(rendezvous, None)


def start(store: dist.TCPStore, rank: int, parent_pid: int | None) -> threading.Thread:
    """Bump ``rank``'s counter until the process ends; exit at once if ``parent_pid`` (the
    engine that spawned this rank) is gone."""

    def beat() -> None:
        count = 0
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                os._exit(3)  # the engine died without shutting us down: leave nothing behind
            count += 1
            try:
                store.set(_BEAT.format(rank), str(count))
            except Exception:  # the store (rank 0) is gone; the next collective fails too
                return
            time.sleep(INTERVAL)

    thread = threading.Thread(target=beat, name=f"pagedkv-heartbeat-{rank}", daemon=True)
    thread.start()
    return thread


def started(store: dist.TCPStore, ranks: list[int]) -> bool:
    """Whether each of ``ranks`` has started: its heartbeat thread wrote its first beat."""
    return store.check([_BEAT.format(rank) for rank in ranks])


def report_error(store: dist.TCPStore, rank: int, message: str) -> None:
    """Leave a dying rank's last words where rank 0 can read them."""
    try:
        store.set(_ERROR.format(rank), message)
    except Exception:
        pass


def reported_error(store: dist.TCPStore, rank: int) -> str | None:
    key = _ERROR.format(rank)
    return store.get(key).decode() if store.check([key]) else None


def silent_ranks(store: dist.TCPStore, ranks: list[int]) -> list[int]:
    """The ranks whose counter does not move over a few intervals (hung, stopped or dead)."""

    def counters() -> dict[int, bytes | None]:
        return {r: store.get(_BEAT.format(r)) if store.check([_BEAT.format(r)]) else None for r in ranks}

    before = counters()
    time.sleep(4 * INTERVAL)
    after = counters()
    return [r for r in ranks if after[r] is None or after[r] == before[r]]
