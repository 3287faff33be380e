"""Shared pieces of the server tests: engine options, prompts, /metrics reading, leak checks."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.engine import LLMEngine, RequestOutput

API_KEY = "test-key"
MODEL = "pagedkv-builtin"
#: The main test server's engine (and the reference LLM's, so the numerics match).
ENGINE_OPTIONS = dict(num_kv_blocks=512, block_size=16, max_model_len=256, max_num_seqs=32)

_WORDS = "paged attention keeps the cache in blocks so that many requests share one pool".split()


def prompts(count: int, seed: int, words: int = 6) -> list[str]:
    rng = random.Random(seed)
    return [
        f"request {seed}-{i}: " + " ".join(rng.choice(_WORDS) for _ in range(words)) for i in range(count)
    ]


def complete_in_background(base_url: str, **body) -> threading.Thread:
    """POST a completion (``body`` plus the model) from a thread; an ``EngineGate`` decides when
    it runs. Join the thread to wait for its answer."""
    thread = threading.Thread(
        target=httpx.post,
        args=(f"{base_url}/v1/completions",),
        kwargs={"json": {"model": MODEL, **body}, "timeout": 120},
    )
    thread.start()
    return thread


def scrape(base_url: str) -> dict[str, float]:
    """Every /metrics sample, by name and labels, e.g. ``vllm:num_requests_running``."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = {k: v for k, v in sample.labels.items() if k not in ("model_name", "le")}
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))
            if "le" not in sample.labels:
                samples[key] = sample.value
    return samples


def wait_until(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def wait_idle(base_url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is held; return the metrics."""

    def idle():
        m = scrape(base_url)
        quiet = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        return m if quiet and m["pagedkv:kv_cache_blocks_used"] == 0 else None

    metrics = wait_until(idle, timeout, "the server to go idle with every block back in the pool")
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    assert httpx.get(f"{base_url}/health").status_code == 200
    return metrics


def assert_pool_whole(engine: LLMEngine) -> None:
    """White-box check once idle: no request, block table or block reference is left behind. The
    one holder left is unified LoRA paging's: each page of a resident (idle, unpinned) adapter
    is held once, and counts as free."""
    assert not engine.requests
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.kv_manager.num_seqs == 0
    pool = engine.kv_manager.pool
    paged = engine.scheduler.paged_adapters
    pages = [] if paged is None else [b for r in paged.pages.resident() for b in r.block_ids]
    assert paged is None or (not paged.pinned and all(r.pins == 0 for r in paged.pages.resident()))
    assert all(pool.refcount(b) == (b in pages) for b in range(pool.num_blocks))
    assert pool.num_free_blocks == pool.num_blocks
    held = pool.free_block_ids() + pool.cached_free_block_ids() + pages
    assert sorted(held) == list(range(pool.num_blocks))


class EngineGate:
    """Holds a live engine between steps, as a stalled engine would, so no test races the model.

    A test that needs a request to still be running when its client leaves (or a batch to be
    full when the next request arrives) closes the gate instead of hoping the model is slow: while
    it is closed, ``step()`` returns at once without running, and the server's worker still takes
    commands -- admissions, aborts, the pool's bookkeeping -- exactly as it does between steps. This
    is the one place tests replace an engine method (a stalled engine is the fault it injects);
    leaving the ``with`` block restores the engine's own ``step``.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._open = threading.Event()
        self._open.set()
        self._close_after: Callable[[list[RequestOutput]], bool] | None = None
        #: Set once a step found the gate closed: whatever ran before it is all that will run.
        self.holding = threading.Event()

    def __enter__(self) -> EngineGate:
        self.engine.step = self._step
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.step
        self._open.set()

    def close(self) -> None:
        """No step runs from now on (one in progress finishes)."""
        self.holding.clear()
        self._open.clear()

    def open_until(self, predicate: Callable[[list[RequestOutput]], bool]) -> None:
        """Let steps run until the first whose outputs satisfy ``predicate``; close after it."""
        self.holding.clear()
        self._close_after = predicate
        self._open.set()

    def _step(self) -> list[RequestOutput]:
        if not self._open.is_set():
            self.holding.set()
            time.sleep(0.001)
            return []
        outputs = type(self.engine).step(self.engine)
        if self._close_after is not None and self._close_after(outputs):
            self._close_after = None
            self._open.clear()
        return outputs
