"""The dashboard's view of the engine as plain data, and the compact diffs between two views.

One :class:`View` is taken on the engine's worker thread (the only thread that may read the
engine) from ``kv_snapshot()`` and ``stats()``; everything else -- the diff against the previous
view, the JSON -- works on these copies. A block travels as one integer, ``refcount * 2 +
cached``; who owns it and which tokens it holds the page derives from the block tables, which
travel per sequence and only when they changed. A frame is therefore a few hundred bytes while
requests decode (a token count per sequence) and grows only when blocks move. Resident LoRA
adapters (unified paging) travel the same way as sequences: by name, their pages and pins, only
when they changed; the page draws their pages in a colour of their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine import LLMEngine
from pagedkv.engine.stats import TierStats

#: A sequence's fields as the page reads them: request id, sample/beam index, block table,
#: tokens, prompt tokens, prompt tokens served by the prefix cache, and with KV groups each
#: group's table (the null block where a window passed or a prompt chunk is to come).
_SEQ_FIELDS = ("r", "i", "b", "n", "p", "c", "g")
#: A resident adapter's fields as the page reads them: adapter id, pages, running sequences pinning it.
_ADAPTER_FIELDS = ("id", "b", "pins")
#: Blocks compared as one slice when diffing.
_CHUNK = 256


@dataclass(frozen=True)
class View:
    """The engine at one moment: the blocks' refcounts and cached set as the snapshot has them
    (compared in C when diffing), live sequences by key, counters."""

    refcounts: tuple[int, ...]
    cached: frozenset[int]
    seqs: dict[str, tuple]
    stats: dict[str, float | int]
    #: Resident LoRA adapters by name: (id, pages, pins).
    adapters: dict[str, tuple] = field(default_factory=dict)

    def code(self, block: int) -> int:
        return self.refcounts[block] * 2 + (block in self.cached)

    @property
    def blocks(self) -> list[int]:
        """Every block's code (a full frame's; built only for one)."""
        codes = [refcount * 2 for refcount in self.refcounts]
        for block in self.cached:
            codes[block] += 1
        return codes


def take_view(engine: LLMEngine, stamp: float) -> View:
    """Read the engine (worker thread only): every block, every live block table, the counters;
    ``stamp`` (``time.time()``) is the frame's time, taken by the caller at the instant it
    throttles on, so consecutive frames' times are never closer than the throttle allows."""
    snapshot = engine.kv_snapshot()
    seqs = {
        f"{s.request_id}#{s.index}": (
            s.request_id,
            s.index,
            s.block_ids,
            s.num_tokens,
            s.prompt_tokens,
            s.cached_tokens,
            s.group_tables,
        )
        for s in snapshot.sequences
    }
    stats = engine.stats()
    last = engine.last_step
    counters = {
        "t": round(stamp, 3),
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
        "tier": None if stats.tier is None else _tier_counters(stats.tier),
    }
    if stats.spec_decoding is not None:  # a speculating engine: its drafts since start
        counters["specDrafts"] = stats.spec_decoding.num_drafts
        counters["specDraftTokens"] = stats.spec_decoding.num_draft_tokens
        counters["specAccepted"] = stats.spec_decoding.num_accepted_tokens
    adapters = {a.name: (a.lora_int_id, a.block_ids, a.pins) for a in snapshot.adapters}
    counters["adapterPages"] = sum(len(a.block_ids) for a in snapshot.adapters)
    return View(snapshot.refcounts, snapshot.cached, seqs, counters, adapters)


def _tier_counters(tier: TierStats) -> dict[str, int | str]:
    """The second KV tier beside the pool: its blocks, what it served and what moved."""
    return {
        "medium": tier.medium,
        "total": tier.capacity_blocks,
        "cached": tier.cached_blocks,
        "swap": tier.swap_blocks,
        "queries": tier.query_tokens,
        "hits": tier.hit_tokens,
        "stored": tier.blocks_stored,
        "loaded": tier.blocks_loaded,
        "bytesOut": tier.bytes_out,
        "bytesIn": tier.bytes_in,
    }


def full_frame(view: View, config: dict[str, Any]) -> dict[str, Any]:
    """Everything a page that just connected needs."""
    return {
        "kind": "full",
        "config": config,
        "blocks": view.blocks,
        "seqs": {key: dict(zip(_SEQ_FIELDS, seq, strict=True)) for key, seq in view.seqs.items()},
        "adapters": _adapters(view.adapters),
        "stats": view.stats,
    }


def _adapters(adapters: dict[str, tuple]) -> dict[str, dict[str, Any]]:
    return {name: dict(zip(_ADAPTER_FIELDS, a, strict=True)) for name, a in adapters.items()}


def diff_frame(before: View, after: View) -> dict[str, Any]:
    """What changed from ``before`` to ``after``: blocks as a flat ``[id, code, ...]`` list, new
    sequences in full, changed ones with only their changed fields, ended ones by key."""
    # A step changes a few blocks of thousands: compare slices (in C), walk only those that differ.
    changed = set(before.cached ^ after.cached)
    for start in range(0, len(after.refcounts), _CHUNK):
        old, new = before.refcounts[start : start + _CHUNK], after.refcounts[start : start + _CHUNK]
        if old != new:
            changed.update(start + k for k, (was, now) in enumerate(zip(old, new, strict=True)) if was != now)
    blocks = [number for block in sorted(changed) for number in (block, after.code(block))]
    seqs: dict[str, dict[str, Any]] = {}
    for key, seq in after.seqs.items():
        old = before.seqs.get(key)
        if old is None:
            seqs[key] = dict(zip(_SEQ_FIELDS, seq, strict=True))
        elif old != seq:  # only the tables, the tokens and the cache hits change
            changes = ((2, "b"), (3, "n"), (5, "c"), (6, "g"))
            seqs[key] = {name: seq[k] for k, name in changes if old[k] != seq[k]}
    gone = [key for key in before.seqs if key not in after.seqs]
    frame = {"kind": "diff", "blocks": blocks, "seqs": seqs, "gone": gone, "stats": after.stats}
    if before.adapters != after.adapters:  # an adapter loaded, evicted, pinned or unpinned
        changed_adapters = {k: a for k, a in after.adapters.items() if before.adapters.get(k) != a}
        frame["adapters"] = _adapters(changed_adapters)
        frame["adaptersGone"] = [name for name in before.adapters if name not in after.adapters]
    return frame


def encode(frame: dict[str, Any]) -> str:
    """One server-sent event carrying ``frame`` as compact JSON."""
    return f"data: {json.dumps(frame, separators=(',', ':'))}\n\n"
