"""Run every experiment on one configuration and gather the results into one document.

Each experiment draws from its own random stream, derived from ``(seed, experiment, ...)``, so
skipping or resizing one never shifts the numbers of another, and one seed gives one document.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from pagedkv.memory import GPT_STYLE_7B, KVSpec, parse_bytes
from pagedkv.memory.kv_bytes import KV_CACHE_DTYPE_NAMES, QUANTIZED_KV_DTYPES
from pagedkv.sim.allocators import CONTIGUOUS_POLICIES
from pagedkv.sim.experiments import (
    BlockSizeRow,
    PrefixSharing,
    WorkedExample,
    block_size_sweep,
    capacity,
    prefix_sharing,
    worked_example,
)
from pagedkv.sim.hybrid import HybridCapacity, expand_layer_windows, hybrid_capacity
from pagedkv.sim.snapshot import ALLOCATORS, Snapshot, take_snapshot
from pagedkv.sim.trace import TraceResult, run_contiguous, run_paged
from pagedkv.sim.workloads import Request, Workload, poisson_arrivals

#: How each allocator is named in the JSON document: the Max policy is "the naive one".
JSON_NAMES = {"max": "naive", "pow2": "pow2", "oracle": "oracle", "paged": "paged"}

DEFAULT_PREFIX_LEN = 600

# Random stream ids, one per experiment.
_SNAPSHOT, _TRACE, _PREFIX, _CAPACITY, _HYBRID = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation depends on. Memory sizes are bytes."""

    workload: str = "normal"
    seed: int = 0
    block_size: int = 16
    max_seq_len: int = 2048
    gpu_memory: int = parse_bytes("80GB")
    weights_memory: int = parse_bytes("13GiB")
    #: the model's KV shape and dtype
    kv_spec: KVSpec = GPT_STYLE_7B
    #: "auto" stores ``kv_spec.dtype``; "fp8" / "int8" one byte per element plus a float32
    #: scale per token and KV head (what the engine's quantized cache stores)
    kv_cache_dtype: str = "auto"
    prefix_len: int | None = None  # None: DEFAULT_PREFIX_LEN, or half the context if that is less
    batch_sizes: tuple[int, ...] = (10, 25, 50, 100, 150, 200)
    sweep_batch_size: int = 100
    block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    prefix_requests: int = 100
    trace_concurrency: int = 200
    trace_steps: int = 5000
    snapshot_moments: int = 8
    #: per layer, repeated over the model's layers, the window it attends over (None: the whole
    #: context); empty: no layer has one, and experiment (g) does not run
    layer_windows: tuple[int | None, ...] = ()
    #: tokens of a prompt one step computes (experiment (g): what a sliding group holds at once)
    prefill_chunk: int = 2048

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "sweep_batch_size",
            "prefix_requests",
            "trace_concurrency",
            "trace_steps",
            "prefill_chunk",
        )
        for name in (*positive, "snapshot_moments"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("batch_sizes", "block_sizes"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v <= 0 for v in values):
                raise ValueError(f"{name} must be non-empty positive integers, got {values!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_NAMES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_memory <= 0:
            raise ValueError(
                f"no memory left for the KV cache: gpu_memory={self.gpu_memory} bytes, "
                f"weights_memory={self.weights_memory} bytes"
            )
        if self.kv_slots < self.max_seq_len:
            raise ValueError(
                f"the KV memory ({self.kv_memory} bytes) holds {self.kv_slots} tokens, "
                f"fewer than one max_seq_len={self.max_seq_len} request"
            )
        self.make_workload(self.workload)
        self.make_workload("shared-prefix")
        if self.layer_windows:
            expand_layer_windows(self.layer_windows, self.kv_spec.num_layers)

    @property
    def stored_kv_spec(self) -> KVSpec:
        """What one token costs as stored: ``kv_spec`` in the ``kv_cache_dtype`` element type."""
        if self.kv_cache_dtype == "auto":
            return self.kv_spec
        return dataclasses.replace(self.kv_spec, dtype=QUANTIZED_KV_DTYPES[self.kv_cache_dtype])

    def make_workload(self, name: str) -> Workload:
        return Workload(name, max_seq_len=self.max_seq_len, prefix_len=self.system_prompt_len)

    @property
    def system_prompt_len(self) -> int:
        """Tokens of the shared system prompt (shared-prefix workload, prefix sharing)."""
        if self.prefix_len is not None:
            return self.prefix_len
        return min(DEFAULT_PREFIX_LEN, self.max_seq_len // 2)

    @property
    def kv_memory(self) -> int:
        """Bytes left for the KV cache once the weights are loaded."""
        return self.gpu_memory - self.weights_memory

    @property
    def kv_slots(self) -> int:
        """Token slots in the KV memory."""
        return self.kv_memory // self.stored_kv_spec.bytes_per_token

    def rng(self, *stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *stream])


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    example: WorkedExample
    snapshots: tuple[Snapshot, ...]
    block_sizes: tuple[BlockSizeRow, ...]
    prefix: PrefixSharing
    capacity: dict[str, int]
    arrival_rate: float
    trace: dict[str, TraceResult]
    #: experiment (g), with ``layer_windows`` only
    hybrid: HybridCapacity | None = None

    def snapshot(self, batch_size: int) -> Snapshot:
        return next(s for s in self.snapshots if s.batch_size == batch_size)

    def to_json(self) -> dict:
        """The document ``pagedkv simulate --json`` prints (see the design notes)."""
        cfg = self.config
        bpt = cfg.stored_kv_spec.bytes_per_token
        bpb = cfg.stored_kv_spec.bytes_per_block(cfg.block_size)
        ex, px = self.example, self.prefix
        return {
            "config": {
                "workload": cfg.workload,
                "seed": cfg.seed,
                "block_size": cfg.block_size,
                "max_seq_len": cfg.max_seq_len,
                "gpu_memory_bytes": cfg.gpu_memory,
                "weights_memory_bytes": cfg.weights_memory,
                "kv_memory_bytes": cfg.kv_memory,
                "prefix_len": cfg.system_prompt_len,
                "kv_cache_dtype": cfg.kv_cache_dtype,
                "kv_spec": {
                    "num_layers": cfg.stored_kv_spec.num_layers,
                    "num_kv_heads": cfg.stored_kv_spec.num_kv_heads,
                    "head_dim": cfg.stored_kv_spec.head_dim,
                    "dtype": cfg.stored_kv_spec.dtype,
                },
            },
            "kv_bytes_per_token": bpt,
            "example": {
                "lengths": list(ex.lengths),
                "max_seq_len": ex.max_seq_len,
                "block_size": ex.block_size,
                "naive_slots": ex.naive_slots,
                "paged_slots": ex.paged_slots,
                "ratio": ex.ratio,
                "naive_bytes": ex.naive_slots * bpt,
                "paged_bytes": ex.paged_slots * bpt,
            },
            "batches": [
                {"batch_size": s.batch_size}
                | {JSON_NAMES[name]: s.breakdowns[name].to_json(bpt) for name in ALLOCATORS}
                for s in self.snapshots
            ],
            "block_sizes": [
                {
                    "block_size": row.block_size,
                    "wasted_slots": row.wasted_slots,
                    "wasted_bytes": round(row.wasted_slots * bpt),
                    "waste_fraction": row.waste_fraction,
                    "table_entries": row.table_entries,
                }
                for row in self.block_sizes
            ],
            "prefix_sharing": {
                "num_requests": px.num_requests,
                "prefix_len": px.prefix_len,
                "bytes_without_sharing": px.blocks_without_sharing * bpb,
                "bytes_with_sharing": px.blocks_with_sharing * bpb,
                "saved_fraction": 1 - px.blocks_with_sharing / px.blocks_without_sharing,
                "shared_blocks": px.shared_blocks,
                "cow_copies": px.cow_copies,
            },
            "capacity": {
                "kv_memory_bytes": cfg.kv_memory,
                "naive_requests": self.capacity["max"],
                "paged_requests": self.capacity["paged"],
                "ratio": self.capacity["paged"] / self.capacity["max"],
                "pow2_requests": self.capacity["pow2"],
                "oracle_requests": self.capacity["oracle"],
            },
            "trace": {
                "steps": cfg.trace_steps,
                "target_concurrency": cfg.trace_concurrency,
                "arrival_rate": self.arrival_rate,
                "allocators": {JSON_NAMES[k]: v.to_json(bpt) for k, v in self.trace.items()},
            },
            "hybrid": None if self.hybrid is None else self.hybrid.to_json(),
        }


def trace_arrivals(config: SimConfig) -> tuple[float, list[tuple[int, Request]]]:
    """Poisson arrivals whose offered load is ``trace_concurrency`` requests in flight.

    By Little's law a request in flight for ``output_len`` steps on average, arriving at rate r,
    gives r * mean(output_len) requests in flight; the mean is estimated from 4,096 draws.
    """
    workload = config.make_workload(config.workload)
    mean_output = np.mean([r.output_len for r in workload.sample(config.rng(_TRACE, 0), 4096)])
    rate = config.trace_concurrency / float(mean_output)
    rng = config.rng(_TRACE, 1)
    counts = poisson_arrivals(rng, rate, config.trace_steps)
    requests = iter(workload.sample(rng, int(counts.sum())))
    return rate, [(step, next(requests)) for step, n in enumerate(counts) for _ in range(n)]


def simulate(config: SimConfig, progress: bool = False) -> SimResult:
    """Run experiments (a)-(f) of the simulator on ``config``."""
    workload = config.make_workload(config.workload)
    sizes = sorted(set(config.batch_sizes) | {config.sweep_batch_size})
    bar = tqdm(total=len(sizes) + 7, desc="simulating", disable=not progress, leave=False)

    def step(label: str) -> None:
        bar.set_postfix_str(label)
        bar.update()

    snapshots = {}
    for n in sizes:
        snapshots[n] = take_snapshot(
            workload, n, config.block_size, config.rng(_SNAPSHOT, n), config.snapshot_moments
        )
        step(f"snapshot N={n}")
    sweep = block_size_sweep(snapshots[config.sweep_batch_size].moments, config.block_sizes)
    step("block sizes")
    prefix = prefix_sharing(
        config.make_workload("shared-prefix"), config.prefix_requests, config.block_size, config.rng(_PREFIX)
    )
    step("prefix sharing")
    fits = capacity(workload, config.kv_slots, config.block_size, config.rng(_CAPACITY))
    step("capacity")
    rate, arrivals = trace_arrivals(config)
    trace = {}
    for policy in CONTIGUOUS_POLICIES:
        trace[policy] = run_contiguous(
            policy, arrivals, config.kv_slots, config.max_seq_len, config.trace_steps
        )
        step(f"trace {policy}")
    trace["paged"] = run_paged(
        arrivals,
        config.kv_slots // config.block_size,
        config.block_size,
        config.max_seq_len,
        config.trace_steps,
    )
    step("trace paged")
    hybrid = None
    if config.layer_windows:
        windows = expand_layer_windows(config.layer_windows, config.kv_spec.num_layers)
        hybrid = hybrid_capacity(
            workload, config.kv_slots, config.block_size, windows, config.prefill_chunk, config.rng(_HYBRID)
        )
    bar.close()
    return SimResult(
        config=config,
        example=worked_example(max_seq_len=config.max_seq_len, block_size=config.block_size),
        snapshots=tuple(snapshots[n] for n in sorted(set(config.batch_sizes))),
        block_sizes=tuple(sweep),
        prefix=prefix,
        capacity=fits,
        arrival_rate=rate,
        trace=trace,
        hybrid=hybrid,
    )
