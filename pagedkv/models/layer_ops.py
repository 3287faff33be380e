"""The decoder layer's element-wise ops, as one object per forward pass: fused C on the CPU,
torch everywhere else.

A small model's decode step on the CPU spends as much time between its matrix multiplies as in
them: each RMSNorm is five to seven torch dispatches, rotary five, the KV write two ``index_copy_``
and a host sync on the padding mask. :class:`NativeOps` runs each group as one call into the
kernels library (``pagedkv/kernels/csrc/layer_ops.c``, through :mod:`pagedkv.kernels.library`),
rounding where transformers rounds, so float32 greedy tokens still equal transformers' and
bfloat16 stays as close as torch's own ops. :class:`TorchOps` is the reference and the fallback:
CUDA, a dtype the library lacks, no C compiler, a quantized KV cache (its write). Both take and
return the same tensors; :func:`select` picks one per forward pass.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.attention import AttentionMetadata, LayerKV, per_call_checks, write_kv
from pagedkv.attention.checks import check_slots
from pagedkv.kernels import library
from pagedkv.kernels.library import KernelLibrary, KernelsUnavailable
from pagedkv.kernels.signatures import SUFFIXES
from pagedkv.models.rope import apply_rotary

logger = logging.getLogger(__name__)

#: the ops :class:`NativeOps` takes from the library, for each dtype
_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_write_kv", "offset_rms_norm", "gelu_tanh_and_mul")


@dataclass(frozen=True)
class QKVLayout:
    """How a layer's packed q/k/v projection output is laid out, and its optional per-head
    q/k RMSNorm weights (Qwen3; Gemma 3's, with ``offset``, are ``1 + weight`` norms)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 0.0
    offset: bool = False


class TorchOps:
    """The ops as torch operators, in transformers' order: RMSNorm in float32, cast back, weight
    applied after the cast (``F.rms_norm`` folds it in float32, where the cast is a no-op)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(x + residual) * weight, x + residual)``, the sum written into ``residual``
        (as the fused C op writes it): the residual stays in its own tensor, never in a
        projection's kept output."""
        residual = residual.add_(x)  # r + x == x + r exactly
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: silu's output is ours

    def offset_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: ``rmsnorm(x) * (1 + weight)`` in float32, cast back once, written
        as transformers' ``Gemma2RMSNorm`` computes it (bit for bit)."""
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * (1.0 + weight.float())).to(x.dtype)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)  # in place: gelu's output is ours

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        layout: QKVLayout,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: LayerKV,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotate q and k of ``qkv [T, (Hq + 2 Hkv) D]``, store k and v in their slots
        (``metadata.slot_mapping``); returns q ``[T, Hq, D]``."""
        tokens, heads, kv_heads = qkv.shape[0], layout.num_heads, layout.num_kv_heads
        qk, v = qkv.split(((heads + kv_heads) * layout.head_dim, kv_heads * layout.head_dim), dim=-1)
        qk = qk.view(tokens, heads + kv_heads, layout.head_dim)
        if layout.q_norm is not None:  # separate weights for query and key heads
            q, k = qk.split((heads, kv_heads), dim=1)
            norm = self.offset_rms_norm if layout.offset else self.rms_norm
            normed = (norm(q, layout.q_norm, layout.eps), norm(k, layout.k_norm, layout.eps))
            qk = torch.cat(normed, dim=1)
        # one rotation for the query and key heads together
        q, k = apply_rotary(qk, cos, sin).split((heads, kv_heads), dim=1)
        v = v.view(tokens, kv_heads, layout.head_dim)
        write_kv(k, v, layer, metadata.slot_mapping, metadata.has_padding)
        return q


TORCH_OPS = TorchOps()


class NativeOps(TorchOps):
    """The compiled ops for one dtype, on contiguous CPU tensors of that dtype; a layer whose
    KV cache is quantized or of another dtype writes through :class:`TorchOps`."""

    def __init__(self, lib: KernelLibrary, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.max_head_dim = lib.entry("layer_ops_max_head_dim")()
        for name in _OPS:
            setattr(self, f"_{name}", lib.entry(f"{name}_{SUFFIXES[dtype]}"))

    def _fits(self, weight: torch.Tensor, size: int) -> bool:
        """Whether ``weight`` is what the C reads for rows of ``size``: the C trusts shapes."""
        return weight.dtype == self.dtype and weight.shape == (size,) and weight.is_contiguous()

    def _norm(
        self, entry: Callable[..., None], x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``entry`` (a compiled norm) over the rows of ``x``, which ``weight`` fits."""
        x = x.contiguous()
        out = torch.empty_like(x)
        entry(x.data_ptr(), out.data_ptr(), weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
        return out

    def _act_and_mul(self, entry: Callable[..., None], gate_up: torch.Tensor) -> torch.Tensor:
        """``entry`` (a compiled ``act(gate) * up``) over the rows of ``gate_up [T, 2 n]``."""
        gate_up = gate_up.contiguous()
        half = gate_up.shape[-1] // 2
        out = gate_up.new_empty((gate_up.shape[0], half))
        entry(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], half)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._fits(weight, x.shape[-1]):
            return super().rms_norm(x, weight, eps)
        return self._norm(self._rms_norm, x, weight, eps)

    def offset_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._fits(weight, x.shape[-1]):
            return super().offset_rms_norm(x, weight, eps)
        return self._norm(self._offset_rms_norm, x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fits = self._fits(weight, x.shape[-1]) and x.shape == residual.shape
        if not (fits and x.is_contiguous() and residual.is_contiguous()):
            return super().add_rms_norm(x, residual, weight, eps)
        self._add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[-1], eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.shape[-1] % 2:
            return super().silu_and_mul(gate_up)
        return self._act_and_mul(self._silu_and_mul, gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.shape[-1] % 2:
            return super().gelu_tanh_and_mul(gate_up)
        return self._act_and_mul(self._gelu_tanh_and_mul, gate_up)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        layout: QKVLayout,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: LayerKV,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
        key, value, slot_mapping = layer.key, layer.value, metadata.slot_mapping
        norms = (layout.q_norm, layout.k_norm) if layout.q_norm is not None else ()
        if (
            layer.quantized
            or key.dtype != self.dtype
            or key.shape[2:] != (kv_heads, dim)
            or qkv.shape[-1] != (heads + 2 * kv_heads) * dim
            or not cos.dtype == sin.dtype == self.dtype
            or not cos.numel() == sin.numel() == qkv.shape[0] * dim
            or dim > self.max_head_dim
            or dim % 2
            or slot_mapping.dtype != torch.int64
            or not all(self._fits(w, dim) for w in norms)
            or not all(t.is_contiguous() for t in (qkv, key, value, cos, sin))
        ):
            return super().rotary_write_kv(qkv, layout, cos, sin, layer, metadata)
        tokens = qkv.shape[0]
        if per_call_checks():
            check_slots(layer, slot_mapping, tokens)
        q = qkv.new_empty((tokens, heads, dim))
        q_norm, k_norm = layout.q_norm, layout.k_norm
        self._rotary_write_kv(
            qkv.data_ptr(),
            q.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            layout.eps,
            key.data_ptr(),
            value.data_ptr(),
            slot_mapping.data_ptr(),
            tokens,
            heads,
            kv_heads,
            dim,
            layout.offset,
        )
        return q


@functools.cache
def native_ops(dtype: torch.dtype) -> NativeOps | None:
    """The compiled ops for ``dtype``, or None (logged once) when there are none."""
    try:
        lib = library.load()
    except KernelsUnavailable as exc:
        logger.warning("fused CPU layer ops unavailable, using torch ops: %s", exc)
        return None
    if dtype not in SUFFIXES or lib.entry(f"rms_norm_{SUFFIXES[dtype]}") is None:
        return None  # float16 is missing from builds without _Float16
    return NativeOps(lib, dtype)


def select(x: torch.Tensor) -> TorchOps:
    """The ops for activations like ``x``: compiled on the CPU when they build, else torch."""
    if x.device.type == "cpu":
        ops = native_ops(x.dtype)
        if ops is not None:
            return ops
    return TORCH_OPS
