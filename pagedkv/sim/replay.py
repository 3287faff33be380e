"""The data of the HTML replay: naive vs paged memory, step by step, as one compact document.

The replay must redraw every allocator's memory map at any step, yet stay a few hundred KB. A
frame-by-frame dump of the paged pool (thousands of blocks times hundreds of frames) would not;
the residencies do: one record per admission, from which the page derives the exact layout at
any step (see :class:`~pagedkv.sim.trace.Residency`). Their columns are packed as base64
little-endian integer arrays. Only the curves are sampled, at the frames the slider stops at.
The paged block ids are most of the file (about 90,000 for the default trace); a run that would
need more than :data:`MAX_BLOCK_IDS` is replayed over its first steps only, and the page says so.

Two scenarios share one format: the worked example (three requests growing token by token) and
the dynamic trace of :mod:`pagedkv.sim.trace`.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence

import numpy as np

from pagedkv.memory import blocks_for
from pagedkv.sim.allocators import ContiguousAllocator
from pagedkv.sim.experiments import WorkedExample
from pagedkv.sim.report import ALLOCATOR_COLORS, LABELS, human_bytes
from pagedkv.sim.simulate import SimResult
from pagedkv.sim.trace import Residency
from pagedkv.sim.workloads import Request

#: Allocators drawn side by side: the naive reservation, the (impossible) oracle, and paging.
REPLAY_ALLOCATORS = ("max", "oracle", "paged")
#: Most positions of the time slider (and samples of each curve) per scenario.
MAX_FRAMES = 500
SERIES = ("running", "stored", "held", "waiting")
#: Most paged block ids one replay carries: at most 1.3 MB of base64 (uint32 ids).
MAX_BLOCK_IDS = 250_000


def frame_steps(steps: int, max_frames: int = MAX_FRAMES) -> list[int]:
    """At most ``max_frames`` steps, evenly spread from the first step to the last."""
    if steps <= 0 or max_frames <= 0:
        raise ValueError(f"need at least one step and one frame, got {steps} steps, {max_frames} frames")
    if steps <= max_frames:
        return list(range(steps))
    if max_frames == 1:
        return [steps - 1]
    return sorted({round(i * (steps - 1) / (max_frames - 1)) for i in range(max_frames)})


def pack(values: Sequence[int]) -> dict:
    """Non-negative integers as base64 of little-endian uint16 (when they fit) or uint32."""
    array = np.asarray(values, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= 2**32):
        raise ValueError("only integers in [0, 2**32) can be packed")
    kind = "u16" if not array.size or array.max() < 2**16 else "u32"
    data = array.astype("<u2" if kind == "u16" else "<u4").tobytes()
    return {"type": kind, "data": base64.b64encode(data).decode("ascii")}


def unpack(packed: dict) -> list[int]:
    """The inverse of :func:`pack` (the page does the same in JavaScript)."""
    dtype = {"u16": "<u2", "u32": "<u4"}[packed["type"]]
    return np.frombuffer(base64.b64decode(packed["data"]), dtype=dtype).tolist()


def series_at(residencies: Sequence[Residency], step: int, block_size: int | None) -> dict[str, int]:
    """Running, stored and held slots at ``step``, from the residencies alone (``block_size``
    None: contiguous regions). Nothing waits in a scenario described only by its residencies."""
    live = [r for r in residencies if r.admitted <= step < r.left]
    if block_size is None:
        held = sum(r.placement[1] for r in live)
    else:
        held = sum(blocks_for(r.stored_at(step), block_size) * block_size for r in live)
    return {"running": len(live), "stored": sum(r.stored_at(step) for r in live), "held": held, "waiting": 0}


def example_residencies(example: WorkedExample, allocator: str) -> tuple[tuple[Residency, ...], int]:
    """The worked example's requests as residencies (admitted at step 0 with their first token,
    kept until the last request is complete) and the memory they are drawn in, in slots: the
    contiguous footprint, or the paged pool."""
    steps = max(example.lengths)
    if allocator == "paged":
        placements = example.block_ids
        capacity = sum(map(len, placements)) * example.block_size
    else:
        space = ContiguousAllocator(allocator, example.max_seq_len)
        for key, n in enumerate(example.lengths):
            space.try_allocate(key, Request(prompt_len=n, output_len=0))
        placements = tuple(space.region(key) for key in range(len(example.lengths)))
        capacity = space.space.footprint
    residencies = tuple(
        Residency(key, 0, steps, 1, n, tuple(placement))
        for key, (n, placement) in enumerate(zip(example.lengths, placements, strict=True))
    )
    return residencies, capacity


def caption(allocator: str, capacity: int, block_size: int, max_seq_len: int) -> str:
    """How ``allocator`` places a request, and the size of the memory it is drawn in."""
    if allocator == "paged":
        return f"{capacity // block_size:,} blocks of {block_size} slots, taken one at a time as tokens come"
    if allocator == "max":
        how = f"reserves max_seq_len = {max_seq_len:,} slots per request"
    else:
        how = "reserves each request's final length (it knows the future)"
    return f"{capacity:,} slots; {how}, in one piece"


def _memory(
    allocator: str,
    capacity: int,
    block_size: int,
    max_seq_len: int,
    residencies: Sequence[Residency],
    series: dict,
) -> dict:
    columns = {
        name: pack([getattr(r, name) for r in residencies])
        for name in ("request", "admitted", "left", "tokens", "final_len")
    }
    if allocator == "paged":
        columns["num_blocks"] = pack([len(r.placement) for r in residencies])
        columns["blocks"] = pack([block for r in residencies for block in r.placement])
    else:
        columns["start"] = pack([r.placement[0] for r in residencies])
        columns["size"] = pack([r.placement[1] for r in residencies])
    return {
        "allocator": allocator,
        "label": LABELS[allocator],
        "color": ALLOCATOR_COLORS[allocator],
        "kind": "paged" if allocator == "paged" else "contiguous",
        "caption": caption(allocator, capacity, block_size, max_seq_len),
        "capacity_slots": capacity,
        "num_blocks": capacity // block_size if allocator == "paged" else None,
        "count": len(residencies),
        "residencies": columns,
        "series": series,
    }


def _example_scenario(result: SimResult, max_frames: int) -> dict:
    ex = result.example
    frames = frame_steps(max(ex.lengths), max_frames)
    memories = []
    footprints = {}
    for allocator in REPLAY_ALLOCATORS:
        residencies, capacity = example_residencies(ex, allocator)
        footprints[allocator] = capacity
        block_size = ex.block_size if allocator == "paged" else None
        samples = [series_at(residencies, step, block_size) for step in frames]
        series = {name: [s[name] for s in samples] for name in SERIES}
        memories.append(_memory(allocator, capacity, ex.block_size, ex.max_seq_len, residencies, series))
    lengths = ", ".join(map(str, ex.lengths[:-1])) + f" and {ex.lengths[-1]}"
    return {
        "id": "example",
        "label": "Worked example",
        "description": (
            f"Three requests of {lengths} tokens grow one token per step. The naive system reserves "
            f"max_seq_len = {ex.max_seq_len:,} slots for each: {ex.naive_slots:,} slots. Paged, they "
            f"hold {ex.paged_slots // ex.block_size} blocks of {ex.block_size} = {ex.paged_slots} slots "
            f"({ex.ratio:.0f}x less); even an oracle that knew every final length would need "
            f"{footprints['oracle']} slots, each request in one piece. Drawn to the same scale."
        ),
        "steps": max(ex.lengths),
        "block_size": ex.block_size,
        "frames": frames,
        "start_frame": len(frames) - 1,
        "memories": memories,
    }


def replay_window(paged: Sequence[Residency], steps: int, max_block_ids: int) -> int:
    """How many leading steps of a run can be replayed with at most ``max_block_ids`` block ids:
    the residencies admitted before that step hold no more (``paged`` is sorted by admission)."""
    total = 0
    for residency in paged:
        total += len(residency.placement)
        if total > max_block_ids:
            return max(residency.admitted, 1)
    return steps


def clip(residencies: Sequence[Residency], window: int, block_size: int | None) -> tuple[Residency, ...]:
    """The residencies of the first ``window`` steps, as they stood then: those admitted later
    are dropped, the others leave at ``window`` at the latest and, paged, keep only the blocks
    they held by then."""
    clipped = []
    for r in residencies:
        if r.admitted >= window:
            continue
        left = min(r.left, window)
        placement = r.placement
        if block_size is not None:
            placement = placement[: blocks_for(r.stored_at(left - 1), block_size)]
        clipped.append(dataclasses.replace(r, left=left, placement=placement))
    return tuple(clipped)


def _trace_scenario(result: SimResult, max_frames: int, max_block_ids: int) -> dict:
    cfg = result.config
    window = replay_window(result.trace["paged"].residencies, cfg.trace_steps, max_block_ids)
    frames = frame_steps(window, max_frames)
    memories = []
    for allocator in REPLAY_ALLOCATORS:
        run = result.trace[allocator]
        series = {name: [getattr(run, name)[step] for step in frames] for name in SERIES}
        residencies = clip(run.residencies, window, cfg.block_size if allocator == "paged" else None)
        memories.append(
            _memory(allocator, run.capacity_slots, cfg.block_size, cfg.max_seq_len, residencies, series)
        )
    shown = (
        ""
        if window == cfg.trace_steps
        else (f" Replayed: the first {window:,} steps (a replay keeps at most {max_block_ids:,} block ids).")
    )
    naive, paged = result.trace["max"], result.trace["paged"]
    busiest = next(m for m in memories if m["allocator"] == "paged")["series"]["running"]
    return {
        "id": "trace",
        "label": "Dynamic trace",
        "description": (
            f"{cfg.trace_steps:,} steps of Poisson arrivals ({result.arrival_rate:.3f} requests per step, "
            f"about {cfg.trace_concurrency} in flight offered) through {human_bytes(cfg.kv_memory)} of KV "
            f"memory ({cfg.kv_slots:,} token slots); each step every running request stores one token. "
            f"Paged runs {paged.mean_running:.0f} requests at once on average against "
            f"{naive.mean_running:.0f} naive ({paged.mean_running / naive.mean_running:.1f}x) and "
            f"completes {paged.completed:,} against {naive.completed:,}; token states fill "
            f"{paged.breakdown.utilization:.0%} of the memory it uses against "
            f"{naive.breakdown.utilization:.0%}.{shown}"
        ),
        "steps": window,
        "block_size": cfg.block_size,
        "frames": frames,
        "start_frame": busiest.index(max(busiest)),  # the paged pool at its fullest
        "memories": memories,
    }


def replay_document(
    result: SimResult, max_frames: int = MAX_FRAMES, max_block_ids: int = MAX_BLOCK_IDS
) -> dict:
    """Everything the replay page shows, as one JSON-able document."""
    cfg = result.config
    return {
        "title": "pagedkv simulate: naive vs paged KV memory",
        "subtitle": (
            f"workload {cfg.workload}, seed {cfg.seed}, block size {cfg.block_size}, "
            f"max_seq_len {cfg.max_seq_len:,}, "
            f"{human_bytes(cfg.stored_kv_spec.bytes_per_token)} of KV per token"
        ),
        "scenarios": [
            _example_scenario(result, max_frames),
            _trace_scenario(result, max_frames, max_block_ids),
        ],
    }
