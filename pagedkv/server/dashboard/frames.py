"""The dashboard's view of the engine as plain data, and the compact diffs between two views.

One :class:`View` is taken on the engine's worker thread (the only thread that may read the
engine) from ``kv_snapshot()`` and ``stats()``; everything else -- the diff against the previous
view, the JSON -- works on these copies. A block travels as one integer, ``refcount * 2 +
cached``; who owns it and which tokens it holds the page derives from the block tables, which
travel per sequence and only when they changed. A frame is therefore a few hundred bytes while
requests decode (a token count per sequence) and grows only when blocks move.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.engine import LLMEngine

#: A sequence's fields as the page reads them: request id, sample/beam index, block table,
#: tokens, prompt tokens, prompt tokens served by the prefix cache.
_SEQ_FIELDS = ("r", "i", "b", "n", "p", "c")
#: Blocks compared as one slice when diffing.
_CHUNK = 256


@dataclass(frozen=True)
class View:
    """The engine at one moment: block codes, live sequences by key, counters."""

    blocks: list[int]
    seqs: dict[str, tuple]
    stats: dict[str, float | int]


def take_view(engine: LLMEngine) -> View:
    """Read the engine (worker thread only): every block, every live block table, the counters."""
    snapshot = engine.kv_snapshot()
    blocks = [refcount * 2 for refcount in snapshot.refcounts]
    for block in snapshot.cached:
        blocks[block] += 1
    seqs = {
        f"{s.request_id}#{s.index}": (
            s.request_id,
            s.index,
            list(s.block_ids),
            s.num_tokens,
            s.prompt_tokens,
            s.cached_tokens,
        )
        for s in snapshot.sequences
    }
    stats = engine.stats()
    last = engine.last_step
    counters = {
        "t": round(time.time(), 3),
        "step": stats.steps,
        "running": stats.running,
        "waiting": stats.waiting,
        "used": stats.kv.used_blocks,
        "cached": stats.kv.cached_blocks,
        "cachedFree": stats.kv.cached_free_blocks,
        "preemptions": stats.preemptions,
        "generated": stats.generated_tokens,
        "prefixQueries": stats.prefix_cache_queries,
        "prefixHits": stats.prefix_cache_hits,
        "stepTime": round(last.step_time_s, 5) if last is not None else 0.0,
    }
    return View(blocks, seqs, counters)


def full_frame(view: View, config: dict[str, Any]) -> dict[str, Any]:
    """Everything a page that just connected needs."""
    return {
        "kind": "full",
        "config": config,
        "blocks": view.blocks,
        "seqs": {key: dict(zip(_SEQ_FIELDS, seq, strict=True)) for key, seq in view.seqs.items()},
        "stats": view.stats,
    }


def diff_frame(before: View, after: View) -> dict[str, Any]:
    """What changed from ``before`` to ``after``: blocks as a flat ``[id, code, ...]`` list, new
    sequences in full, changed ones with only their changed fields, ended ones by key."""
    blocks: list[int] = []
    # A step changes a few blocks of thousands: compare slices (in C), walk only those that differ.
    for start in range(0, len(after.blocks), _CHUNK):
        old, new = before.blocks[start : start + _CHUNK], after.blocks[start : start + _CHUNK]
        if old != new:
            for block, (was, now) in enumerate(zip(old, new, strict=True), start):
                if was != now:
                    blocks += (block, now)
    seqs: dict[str, dict[str, Any]] = {}
    for key, seq in after.seqs.items():
        old = before.seqs.get(key)
        if old is None:
            seqs[key] = dict(zip(_SEQ_FIELDS, seq, strict=True))
        elif old != seq:
            fields = zip(_SEQ_FIELDS, old, seq, strict=True)
            seqs[key] = {name: new for name, was, new in fields if was != new}
    gone = [key for key in before.seqs if key not in after.seqs]
    return {"kind": "diff", "blocks": blocks, "seqs": seqs, "gone": gone, "stats": after.stats}


def encode(frame: dict[str, Any]) -> str:
    """One server-sent event carrying ``frame`` as compact JSON."""
    return f"data: {json.dumps(frame, separators=(',', ':'))}\n\n"
