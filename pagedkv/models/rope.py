"""Rotary position embeddings, computed exactly as transformers computes them.

Logits only match a reference to 1e-4 if every rounding matches too, so the inverse
frequencies are built in float32 with transformers' formulas (default, linear, llama3, yarn,
dynamic NTK, longrope; a GGUF file's per-frequency divisors, llama.cpp's ``rope_freqs``), the
angles are ``position * inv_freq`` in float32, cos/sin are multiplied by the scaling's attention
factor (yarn's and longrope's; 1 otherwise) in float32, and queries/keys rotate with the
``rotate_half`` convention (first half of the head paired with the second half), with cos/sin
cast to the activations' dtype first. Where only part of a head rotates (``partial_rotary_factor``)
the loader reorders query and key rows (:func:`rotary_row_order`) so the same whole-head rotation
applies, with cos 1 and sin 0 on the dimensions that pass.

transformers recomputes two scalings per forward from the sequence's length; pagedkv fixes them
once per model, so every sequence of a batch rotates alike and cached keys never go stale:
dynamic NTK is computed for the whole stretched context (``factor`` times the pretraining length,
as vLLM does; transformers agrees for a sequence of that length and, once it has seen one, for
every sequence longer than the pretraining length); longrope takes its long factors when the
model's context (``max_position_embeddings``) exceeds the pretraining length, its short ones
otherwise (transformers agrees for every sequence longer, resp. not longer, than that length).

transformers computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``.
We fold the minus sign into the sin table instead (``[-sin, sin]``) and swap the halves with one
``torch.roll``: ``x2 * -s`` and ``-x2 * s`` are the same float, so the result is bit-identical
with fewer kernels (roll, mul, mul, add instead of neg, cat, mul, mul, add), and queries and keys
rotate together in one call.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedkv.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_positions: int = 0) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, on the CPU, for a model holding
    ``max_positions`` positions (longrope's choice of factors depends on it)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "default":
        return inv_freq
    if rope.type == "linear":
        return inv_freq / _param(rope, "factor")
    if rope.type == "llama3":
        return _llama3(inv_freq, rope)
    if rope.type == "freq_factors":
        return inv_freq / _factors(rope, "factors", inv_freq)
    if rope.type == "yarn":
        return _yarn(exponents, rope, head_dim)
    if rope.type == "dynamic":
        return _dynamic_ntk(exponents, rope, head_dim)
    if rope.type == "longrope":
        long = max_positions > _param(rope, "original_max_position_embeddings")
        factors = _factors(rope, "long_factor" if long else "short_factor", inv_freq)
        return 1.0 / (factors * rope.theta**exponents)
    raise ValueError(f"unsupported RoPE scaling {rope.type!r}")


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: yarn's ``0.1 ln(factor) + 1`` (or its mscale ratio),
    longrope's ``sqrt(1 + ln(factor) / ln(original length))``, unless the config gives
    ``attention_factor``; 1 for the other scalings."""
    if rope.type not in ("yarn", "longrope"):
        return 1.0
    given = rope.params.get("attention_factor")
    if given is not None:
        return float(given)
    factor = _param(rope, "factor")
    if rope.type == "longrope":
        original = _param(rope, "original_max_position_embeddings")
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = rope.params.get("mscale"), rope.params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _param(rope: RopeConfig, key: str) -> Any:
    if key not in rope.params:
        raise ValueError(f"RoPE scaling {rope.type!r} needs {key!r} in its parameters, got {rope.params}")
    return rope.params[key]


def _factors(rope: RopeConfig, key: str, inv_freq: torch.Tensor) -> torch.Tensor:
    """One float32 divisor per frequency from parameter ``key``."""
    factors = torch.tensor(_param(rope, key), dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{factors.numel()} RoPE {key} for {inv_freq.numel()} frequencies")
    return factors


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(exponents: torch.Tensor, rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: interpolate (divide by ``factor``) the frequencies that turn fewer than
    ``beta_slow`` times over the pretraining length, keep those turning more than ``beta_fast``
    times, ramp linearly between."""
    factor = _param(rope, "factor")
    original = _param(rope, "original_max_position_embeddings")
    beta_fast = rope.params.get("beta_fast") or 32
    beta_slow = rope.params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = rope.theta**exponents
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _dynamic_ntk(exponents: torch.Tensor, rope: RopeConfig, dim: int) -> torch.Tensor:
    """NTK-aware scaling for the stretched context ``factor * original``: a larger base,
    computed in float32 the way transformers computes it from a tensor sequence length."""
    factor = _param(rope, "factor")
    original = _param(rope, "original_max_position_embeddings")
    seq_len = torch.tensor(int(original * factor))
    base = rope.theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base**exponents)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate between."""
    factor = _param(rope, "factor")
    low_freq_factor = _param(rope, "low_freq_factor")
    high_freq_factor = _param(rope, "high_freq_factor")
    old_context_len = _param(rope, "original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for arbitrary (packed, non-contiguous) positions.

    Not an ``nn.Module``: it has no weights, and keeping ``inv_freq`` outside the module tree
    keeps it in float32 on the CPU whatever dtype and device the model is built with.

    The tables are computed once for positions ``[0, n)`` (``n`` doubling on demand up to
    ``max_positions``) and a step gathers its rows: two index selects instead of eight small
    ops per step, each of which runs with cold caches right after the LM head has streamed its
    weights. Every entry is the float the per-step
    formula gives: the angle is one float32 product either way, and torch's sin/cos return the
    same float for an element whether it lands in a vector or in the scalar tail.
    """

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_positions: int, rotary_dim: int | None = None
    ) -> None:
        #: frequencies of the rotating dimensions; the others (:func:`rotary_row_order`) get
        #: cos 1 and sin 0, so they pass through unchanged
        self.inv_freq = inverse_frequencies(rope, rotary_dim or head_dim, max_positions)
        self.head_dim = head_dim
        #: cos and sin are multiplied by it (yarn's and longrope's attention factor)
        self.scale = attention_factor(rope)
        self.max_positions = max_positions
        #: (dtype, device) -> (cos, sign-folded sin) ``[n, head_dim]`` for positions ``[0, n)``
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def positions_covered(self, dtype: torch.dtype, device: torch.device) -> int:
        """Positions the tables for ``dtype`` on ``device`` cover now (0 before the first step)."""
        cos, _ = self._tables.get((dtype, device), (None, None))
        return 0 if cos is None else cos.shape[0]

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and sign-folded ``sin`` (first half negated), ``[T, 1, head_dim]`` in ``dtype``
        for ``positions [T]``, ready to broadcast over the heads of :func:`apply_rotary`.

        ``bound`` (above every position: the step's longest context, from the plan) decides on
        the host whether the tables must grow; without it the positions are read back, which on
        CUDA waits for the device. Tables only ever grow, so a CUDA graph captured after they
        cover every position the engine admits keeps reading live tensors."""
        cos, sin = self._tables.get((dtype, positions.device), (None, None))
        if bound is not None:
            if cos is None or cos.shape[0] < min(bound, self.max_positions):
                cos, sin = self._grow(bound, positions.device, dtype)
        elif cos is None or (
            cos.shape[0] < self.max_positions and positions.numel() and int(positions.max()) >= cos.shape[0]
        ):
            top = int(positions.max()) + 1 if positions.numel() else 1
            cos, sin = self._grow(top, positions.device, dtype)
        return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]

    def _grow(self, top: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables covering positions below ``top``: the next power of two at least 4096, capped
        at ``max_positions`` (a position past it fails the gather with an index error)."""
        size = min(self.max_positions, max(4096, 1 << (max(top, 1) - 1).bit_length()))
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        freqs = torch.arange(size, device=device)[:, None].float() * self.inv_freq
        half, rotating = self.head_dim // 2, freqs.shape[-1]
        freqs = torch.nn.functional.pad(freqs, (0, half - rotating))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scale, emb.sin() * self.scale
        for start in (rotating, half + rotating):  # the dimensions that do not rotate
            cos[:, start : start + half - rotating] = 1.0
            sin[:, start : start + half - rotating] = 0.0
        sin = sin.to(dtype)
        sin[:, :half].neg_()
        tables = cos.to(dtype), sin
        self._tables[(dtype, device)] = tables
        return tables


def rotary_row_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Where each row of a head comes from when only ``rotary_dim`` of its ``head_dim``
    dimensions rotate (transformers: the first ``rotary_dim``, halves paired inside them).

    The loader reorders every query and key head by it (q/k norms too): the rotating halves
    move to the front of each half of the head, the passing dimensions behind them. Then
    :func:`apply_rotary`'s whole-head pairing (``i`` with ``i + head_dim / 2``) pairs exactly
    transformers' rotating dimensions, the passing ones see cos 1 and sin 0, and every kernel
    rotates as for a full-rotary model. Queries and keys move alike, so their dot products are
    the same sums (in another order); values and outputs keep their order."""
    half, rotating = head_dim // 2, rotary_dim // 2
    passing = torch.arange(rotary_dim, head_dim)
    first, second = passing[: half - rotating], passing[half - rotating :]
    return torch.cat((torch.arange(rotating), first, torch.arange(rotating, rotary_dim), second))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by :meth:`RotaryEmbedding.cos_sin`'s tables."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin
