"""The bandwidth floor of a decode step, and each engine's decode steps set against it.

A decode step at a batch that leaves the arithmetic units idle -- every decode step on a GPU
at the batches served, and small ones on a CPU -- is bound by memory: it must read every weight
once (the embedding only for its rows, but the LM head's full matrix, which a tied embedding
shares) and every key and value its sequences attend to. Nothing can run it faster than those
bytes over the device's memory rate. That rate is measured, not taken from a data sheet: the
best of a few device-to-device copies of a large buffer, counted as bytes read plus bytes
written (:func:`measure_copy_rate`). The floor of a step is then::

    (weight bytes + KV bytes read by the step) / copy rate

and an engine's figure is its own decode step time: the run of ``decode-B`` (B requests of the
uniform shape) less its one-token twin ``decode-B-prefill``, over the ``max_tokens - 1`` decode
steps between them. The KV read grows by one token per sequence and step; the floor takes its
mean over those steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.console import Console

from pagedkv.bench.driver import cell, table
from pagedkv.bench.throughput_gemm import linear_shapes

#: bytes of one element of each dtype the benchmark runs
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: bytes each copy of the rate probe moves, per device: well past every cache
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 28}


def weight_bytes(config: dict, dtype: str) -> int:
    """Bytes of the weights one decode step reads: every layer's projections and norms, the
    final norm and the LM head (the embedding's lookup reads only the batch's rows)."""
    shapes = linear_shapes(config)
    per_layer = sum(k * n for name, (k, n) in shapes.items() if name != "lm_head") + 2 * config["hidden_size"]
    k, n = shapes["lm_head"]
    elements = config["num_hidden_layers"] * per_layer + k * n + config["hidden_size"]
    return elements * DTYPE_BYTES[dtype]


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """Bytes of one token's keys and values over every layer."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * DTYPE_BYTES[dtype]


def floor_seconds(
    config: dict, dtype: str, batch: int, prompt_len: int, max_tokens: int, copy_rate_gbs: float
) -> float:
    """The mean floor of the decode steps of ``batch`` requests of ``prompt_len`` + ``max_tokens``:
    step t (1 .. max_tokens - 1) reads each sequence's ``prompt_len + t`` tokens."""
    mean_context = prompt_len + max_tokens / 2
    read = weight_bytes(config, dtype) + batch * mean_context * kv_bytes_per_token(config, dtype)
    return read / (copy_rate_gbs * 1e9)


def measure_copy_rate(device: str, repeats: int = 5) -> float:
    """GB/s of the fastest of ``repeats`` device-to-device copies of :data:`COPY_BYTES`, counting
    the bytes read and the bytes written."""
    import torch

    kind = torch.device(device).type
    elements = COPY_BYTES[kind] // 4
    source = torch.ones(elements, dtype=torch.float32, device=device)
    target = torch.empty_like(source)

    def wait() -> None:
        if kind == "cuda":
            torch.cuda.synchronize(device)

    target.copy_(source)
    wait()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        wait()
        best = min(best, time.perf_counter() - start)
    return 2 * elements * 4 / best / 1e9


@dataclass(frozen=True)
class DecodeFigure:
    """One engine's decode step at one batch, in one dtype, against the floor."""

    engine: str
    dtype: str
    batch: int
    #: None when noise made the one-token twin the slower run: no figure beats a wrong one
    step_ms: float | None
    floor_ms: float

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.step_ms is None else self.batch * 1e3 / self.step_ms

    @property
    def floor_share(self) -> float | None:
        """Floor / step time: 1.0 is as fast as memory allows."""
        return None if self.step_ms is None else self.floor_ms / self.step_ms

    def to_json(self) -> dict:
        fields = {name: getattr(self, name) for name in ("engine", "dtype", "batch", "step_ms", "floor_ms")}
        return fields | {"tokens_per_s": self.tokens_per_s, "floor_share": self.floor_share}


def decode_figure(
    engine: str, dtype: str, batch: int, full_s: float, first_s: float, steps: int, floor_s: float
) -> DecodeFigure:
    """The figure of ``engine``'s ``decode-B`` run of ``full_s`` seconds and its one-token twin of
    ``first_s``, ``steps`` decode steps apart."""
    step = (full_s - first_s) / steps * 1e3 if steps and full_s > first_s else None
    return DecodeFigure(engine, dtype, batch, step, floor_s * 1e3)


def print_decode(
    figures: list[DecodeFigure], titles: dict[str, str], copy_rate_gbs: float | None, console: Console
) -> None:
    """The decode steps table (nothing when no ``--decode-batches`` ran)."""
    if not figures or copy_rate_gbs is None:
        return
    decode = table(
        f"Decode step against the bandwidth floor: (weights + KV read) / {copy_rate_gbs:,.0f} GB/s "
        "(the measured copy rate)",
        ("dtype", "batch", "engine", "step ms", "tokens/s", "floor ms", "% of floor"),
        left=3,
        show_edge=False,
    )
    for f in figures:
        share = f.floor_share
        decode.add_row(
            f.dtype,
            str(f.batch),
            titles[f.engine],
            cell(f.step_ms, ".3f"),
            cell(f.tokens_per_s, ",.0f"),
            cell(f.floor_ms, ".3f"),
            cell(share and share * 100, ".0f"),
        )
    console.print(decode)
