"""The GEMM rate this machine reaches at the model's shapes, and the throughput roofline it implies.

A decoder step is mostly matrix multiplies: q/k/v, o, gate/up, down per layer and the LM head.
We time each shape three ways on the configured threads -- ``F.linear`` (MKL or oneDNN, whichever
torch picks), oneDNN with the weight pre-packed once for the batch size
(``torch.ops.mkldnn._reorder_linear_weight`` then ``_linear_pointwise``, what vLLM's CPU build
does) and, in float32, pagedkv's tiled kernel (:mod:`pagedkv.kernels.tiled_gemm`) -- and take the
fastest as what the hardware can do. Each shape is timed alone, its weight warm in cache; inside
a step the weights come from DRAM, so the ceiling is a warm-cache one. A workload's *roofline* is
then the time its linear layers need at those rates if nothing else ran (attention, sampling and
Python are left out): generated tokens / that time is a ceiling no engine on these kernels can pass.

Shapes follow the packed projections (q/k/v as one matrix, gate/up as one) every fast engine
uses. Prefill runs in chunks of up to ``prefill_chunk`` tokens; decode step t runs the requests
still generating (:meth:`Workload.decode_batch_sizes`); each prompt's last position also passes
through the LM head (that is where its first token comes from). Times at batch sizes between the
measured ones are interpolated linearly: at these sizes a GEMM's time is close to affine in M.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pagedkv.bench.throughput import Workload

if TYPE_CHECKING:
    import torch

KERNELS = ("F.linear", "oneDNN packed", "pagedkv tiled")
#: Decode batch sizes timed; other sizes are interpolated between neighbours.
DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class GemmTiming:
    dtype: str
    shape: str
    m: int
    k: int
    n: int
    kernel: str
    ms: float | None  # None: the kernel is not available on this build
    note: str = ""

    @property
    def gflops(self) -> float | None:
        return None if self.ms is None else 2 * self.m * self.k * self.n / self.ms / 1e6

    def to_json(self) -> dict:
        return asdict(self) | {"gflops": self.gflops}

    def cell(self) -> str:
        return "n/a" if self.ms is None else f"{self.ms:.2f} ({self.gflops:,.0f})"


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each matrix of one layer, plus the LM head, from a config.json."""
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "qkv": (hidden, (heads + 2 * kv_heads) * head_dim),
        "o": (heads * head_dim, hidden),
        "gate_up": (hidden, 2 * config["intermediate_size"]),
        "down": (config["intermediate_size"], hidden),
        "lm_head": (hidden, config["vocab_size"]),
    }


def _best_ms(call: Callable[[], object], budget_s: float = 0.1, min_calls: int = 10) -> float:
    """Milliseconds per call: the 10th percentile of single calls timed for about ``budget_s``.
    A low percentile, not the median: this is a ceiling, and on a shared machine a call that
    lost a core to another process for a scheduler tick is not what the kernel can do."""
    call()  # first call: allocation, oneDNN primitive creation
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_calls or time.perf_counter() < deadline:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 10] * 1e3


def time_gemm(
    dtype: torch.dtype, shape: str, m: int, k: int, n: int, kernel: str, budget_s: float = 0.1
) -> GemmTiming:
    import torch
    import torch.nn.functional as F

    from pagedkv.kernels.tiled_gemm import tiled_linear, to_tiles, why_unavailable

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
    name = str(dtype).removeprefix("torch.")
    if kernel == "F.linear":
        return GemmTiming(name, shape, m, k, n, kernel, _best_ms(lambda: F.linear(x, w), budget_s))
    if kernel == "pagedkv tiled":
        why_not = why_unavailable(dtype)
        if why_not is not None:
            return GemmTiming(name, shape, m, k, n, kernel, None, why_not)
        tiles = to_tiles(w)
        ms = _best_ms(lambda: tiled_linear(x, tiles, None), budget_s)
        return GemmTiming(name, shape, m, k, n, kernel, ms)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        linear = torch.ops.mkldnn._linear_pointwise
        ms = _best_ms(lambda: linear(x, packed, None, "none", [], ""), budget_s)
    except (RuntimeError, AttributeError) as err:  # a torch built without oneDNN, or no bf16 support
        return GemmTiming(name, shape, m, k, n, kernel, None, str(err).splitlines()[0])
    return GemmTiming(name, shape, m, k, n, kernel, ms)


@dataclass
class GemmRates:
    """Every timing of one dtype, and the fastest kernel's time per (shape, M)."""

    timings: list[GemmTiming]

    def best_ms(self, shape: str, m: int) -> float:
        points = sorted(
            {t.m: self._best_at(shape, t.m) for t in self.timings if t.shape == shape and t.ms}.items()
        )
        if len(points) == 1:  # one size measured: scale its time, the best a single point allows
            return points[0][1] * m / points[0][0]
        sizes = [p[0] for p in points]
        i = bisect.bisect_left(sizes, m)
        if i < len(sizes) and sizes[i] == m:
            return points[i][1]
        lo, hi = points[max(0, min(i - 1, len(points) - 2))], points[min(max(i, 1), len(points) - 1)]
        slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
        return max(lo[1] + slope * (m - lo[0]), 0.0)

    def _best_at(self, shape: str, m: int) -> float:
        return min(t.ms for t in self.timings if t.shape == shape and t.m == m and t.ms is not None)


def batch_sizes(workloads: list[Workload], prefill_chunk: int) -> tuple[list[int], list[int]]:
    """(decode sizes, prefill chunk sizes) to time for these workloads."""
    largest = max(w.num_requests for w in workloads)
    decode = sorted({m for m in DECODE_SIZES if m < largest} | {largest})
    prefill = sorted({min(w.prompt_tokens, prefill_chunk) for w in workloads})
    return decode, prefill


def measure_gemm(
    config: dict, dtype: torch.dtype, workloads: list[Workload], prefill_chunk: int, budget_s: float = 0.1
) -> GemmRates:
    """Time every shape at the decode and prefill batch sizes these workloads need, each for
    about ``budget_s`` seconds."""
    decode, prefill = batch_sizes(workloads, prefill_chunk)
    timings = []
    for shape, (k, n) in linear_shapes(config).items():
        sizes = decode if shape == "lm_head" else sorted(set(decode) | set(prefill))
        for m in sizes:
            for kernel in KERNELS:
                timings.append(time_gemm(dtype, shape, m, k, n, kernel, budget_s))
    return GemmRates(timings)


def roofline_seconds(config: dict, workload: Workload, rates: GemmRates, prefill_chunk: int) -> float:
    """Seconds the workload's linear layers take at the fastest measured kernel's rates."""
    layers = config["num_hidden_layers"]
    layer_shapes = [s for s in linear_shapes(config) if s != "lm_head"]

    def step_ms(m: int) -> float:
        return layers * sum(rates.best_ms(s, m) for s in layer_shapes)

    total_ms = 0.0
    prompt = workload.prompt_tokens
    chunk = min(prompt, prefill_chunk)
    full, rest = divmod(prompt, chunk)
    total_ms += full * step_ms(chunk) + (step_ms(rest) if rest else 0.0)
    total_ms += rates.best_ms("lm_head", workload.num_requests)  # each prompt's first token
    for m in workload.decode_batch_sizes():
        total_ms += step_ms(m) + rates.best_ms("lm_head", m)
    return total_ms / 1e3
