"""Experiment (g): a model with sliding-window layers, paged by KV group against every layer
keeping its whole context, in the same KV memory.

Requests come from the workload at uniformly random progress (as in the capacity experiment)
and are admitted in order until the first that does not fit. *Whole context* holds every token
of every layer: the engine's :class:`~pagedkv.memory.KVCacheManager` over ``kv_slots //
block_size`` blocks, each every layer deep. *Hybrid paging* is the engine's
:class:`~pagedkv.memory.hybrid_manager.HybridKVCacheManager` over the same bytes in blocks one KV
group deep (:mod:`pagedkv.memory.kv_groups`): a request's prompt is computed in chunks of
``chunk`` tokens, each sliding group holding a chunk's blocks just before it and handing back,
after it, what its window no longer reads; then its generated tokens, a block's worth at a time.
So a simulated figure is a figure of the real managers; at the hybrid fill, each group's blocks
held and handed back are read from its tables.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.memory import KVCacheManager, PoolExhaustedError
from pagedkv.memory.grouped_table import WindowedBlockTable
from pagedkv.memory.hybrid_manager import HybridKVCacheManager
from pagedkv.memory.kv_groups import plan_kv_groups
from pagedkv.sim.experiments import at_random_progress
from pagedkv.sim.workloads import LiveRequest, Workload

#: The two settings compared, in report order.
SETTINGS = ("hybrid", "whole")


def expand_layer_windows(pattern: Sequence[int | None], num_layers: int) -> tuple[int | None, ...]:
    """``pattern`` (per layer, None: full attention) repeated over ``num_layers`` layers."""
    if not pattern or num_layers % len(pattern):
        raise ValueError(
            f"a layer-window pattern of {len(pattern)} layers does not repeat over {num_layers} layers"
        )
    return tuple(pattern) * (num_layers // len(pattern))


@dataclass(frozen=True)
class GroupUsage:
    """One KV group at the hybrid fill: its window (None: full attention), its layers, the
    blocks its tables hold and those their windows handed back (null entries)."""

    window: int | None
    layers: int
    held_blocks: int
    expired_blocks: int


@dataclass(frozen=True)
class HybridCapacity:
    """Per setting (``SETTINGS``): requests held at once, the pool and the blocks in use at that
    fill (in blocks ``block_layers`` layers deep); and each group's usage at the hybrid fill."""

    layer_windows: tuple[int | None, ...]
    requests: dict[str, int]
    pool_blocks: dict[str, int]
    used_blocks: dict[str, int]
    block_layers: dict[str, int]
    groups: tuple[GroupUsage, ...]

    @property
    def ratio(self) -> float:
        return self.requests["hybrid"] / max(self.requests["whole"], 1)

    def to_json(self) -> dict:
        return {
            "layer_windows": list(self.layer_windows),
            "requests": self.requests,
            "ratio": self.ratio,
            "pool_blocks": self.pool_blocks,
            "used_blocks": self.used_blocks,
            "block_layers": self.block_layers,
            "groups": [vars(group) for group in self.groups],
        }


def hybrid_capacity(
    workload: Workload,
    kv_slots: int,
    block_size: int,
    layer_windows: tuple[int | None, ...],
    chunk: int,
    rng: np.random.Generator,
) -> HybridCapacity:
    """Experiment (g) for a model whose layers attend over ``layer_windows``, in KV memory of
    ``kv_slots`` tokens of every layer (module docstring)."""
    groups = plan_kv_groups(layer_windows)
    if groups is None:
        raise ValueError("no layer has a sliding window: nothing to page by window")
    live = _live_requests(workload, rng)
    drawn: list[LiveRequest] = []

    def nth(i: int) -> LiveRequest:
        while len(drawn) <= i:
            drawn.append(next(live))
        return drawn[i]

    whole = KVCacheManager(kv_slots // block_size, block_size, enable_prefix_caching=False, watermark=0.0)
    hybrid_blocks = kv_slots * len(layer_windows) // (groups.group_size * block_size)
    hybrid = HybridKVCacheManager(hybrid_blocks, groups, block_size, False, 0.0, chunk)
    requests = {
        "hybrid": next(i for i in itertools.count() if not _run(hybrid, i, nth(i), chunk)),
        "whole": next(i for i in itertools.count() if not _run(whole, i, nth(i), chunk)),
    }
    usage = [GroupUsage(w, groups.layer_group.count(g), 0, 0) for g, w in enumerate(groups.windows)]
    for seq in hybrid.seq_ids():
        for g, table in enumerate(hybrid.grouped(seq).tables):
            nulled = table.num_nulled if isinstance(table, WindowedBlockTable) else 0
            held = len(table.block_ids) - nulled
            usage[g] = GroupUsage(
                usage[g].window,
                usage[g].layers,
                usage[g].held_blocks + held,
                usage[g].expired_blocks + nulled,
            )
    return HybridCapacity(
        layer_windows,
        requests,
        {"hybrid": hybrid_blocks - 1, "whole": whole.num_blocks},  # the null block holds nothing
        {"hybrid": hybrid.usage().used_blocks, "whole": whole.usage().used_blocks},
        {"hybrid": groups.group_size, "whole": len(layer_windows)},
        tuple(usage),
    )


def _live_requests(workload: Workload, rng: np.random.Generator) -> Iterator[LiveRequest]:
    stream_rng, progress_rng = rng.spawn(2)
    for request in workload.stream(stream_rng):
        yield from at_random_progress([request], progress_rng)


def _run(kv: KVCacheManager, key: int, live: LiveRequest, chunk: int) -> bool:
    """Hold ``live`` as the engine would, prompt chunk by chunk, then its generated tokens; False
    (its blocks back) when the pool is short."""
    prompt = list(range(live.request.prompt_len))
    try:
        kv.allocate(key, prompt)
        for start in range(0, len(prompt), chunk):
            end = min(start + chunk, len(prompt))
            if not kv.try_hold(key, start, end):
                raise PoolExhaustedError(1, kv.pool.num_free_blocks, kv.num_blocks)
            kv.cache_computed_blocks(key, prompt, end)
        done = len(prompt)
        while done < live.tokens:
            step = min(kv.block_size, live.tokens - done)
            kv.append_slots(key, step)
            done += step
            kv.cache_computed_blocks(key, prompt, done)
    except PoolExhaustedError:
        kv.free(key)
        return False
    return True
